"""The public schema's own tables: tenants, their domains, and where each API token lives."""

from __future__ import annotations

from django.db import models
from django_tenants.models import DomainMixin, TenantMixin

from apps.core.models import Totals


class Tenant(TenantMixin):
    class Status(models.TextChoices):
        ACTIVE = "active"
        SUSPENDED = "suspended"

    slug = models.SlugField(max_length=40, unique=True)
    name = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    suspended_reason = models.TextField(blank=True)
    suspended_at = models.DateTimeField(null=True, blank=True)
    # The provider's cap on the tenant's GPUs in use at once, in whole GPUs; null means no cap.
    gpu_share = models.PositiveIntegerField(null=True, blank=True)
    # What the tenant's work holds now (1/840 GPU units), written by each scheduling cycle, so the
    # provider's pages read it here rather than in the tenant's schema.
    gpu_units_in_use = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    auto_create_schema = True
    auto_drop_schema = True

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def is_suspended(self) -> bool:
        return self.status == self.Status.SUSPENDED


class Domain(DomainMixin):
    def __str__(self) -> str:
        return self.domain


class TokenRoute(models.Model):
    """Which schema holds the token with this prefix.

    Tokens live in their tenant's schema; this index lets a request that presents a token at the wrong
    tenant's domain be told so, instead of a bare "invalid token". The hash is kept so that only the holder
    of the real token learns where it belongs.
    """

    prefix = models.CharField(max_length=16, primary_key=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="token_routes")
    secret_hash = models.CharField(max_length=64)

    def __str__(self) -> str:
        return self.prefix


class TenantUsageDay(Totals):
    """Each tenant's metered usage per day and kind, kept by the ledger's ingest in the public schema, so
    the provider's views never read a tenant's schema at request time."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_days")
    day = models.DateField()
    kind = models.CharField(max_length=10)  # gpu, tokens, storage

    class Meta:
        ordering = ["day", "tenant_id", "kind"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "day", "kind"], name="one_usage_row_per_tenant_day")
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.day} {self.kind}"


class SchemaTemplate(models.Model):
    """A new tenant's schema as SQL: the tables, indexes and recorded migrations that migrating an empty
    schema makes, dumped once per set of migrations (its fingerprint) and replayed under each new tenant's
    name (tenants/template.py)."""

    fingerprint = models.CharField(max_length=64, unique=True)
    sql = models.TextField()
    migrations = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.fingerprint[:12]
