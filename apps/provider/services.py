"""The provider's writes: create, suspend, resume and delete tenants; the public token index.

Tenant creation is all or nothing: the row, its schema and tables, its domain, its first admin and that
admin's token are made in one PostgreSQL transaction (DDL is transactional there), so a failure at any
step leaves no trace. The schema is replayed from the template of the migrations on disk
(tenants/template.py), or migrated where no template can be had.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django_tenants.utils import get_public_schema_name, schema_context

from apps.accounts import services as accounts
from apps.accounts.models import Role
from apps.core.errors import Conflict, InvalidInput
from tenants import template
from tenants.models import Domain, Tenant

SLUG_RE = re.compile(r"[a-z][a-z0-9-]{1,38}[a-z0-9]")
RESERVED_SLUGS = frozenset(
    {"public", "www", "api", "admin", "provider", "static", "media", "pg", "information-schema"}
)


@dataclass(frozen=True)
class CreatedTenant:
    tenant: Tenant
    address: str
    admin_username: str
    admin_token: str


def validate_slug(slug: str) -> str:
    if not SLUG_RE.fullmatch(slug):
        raise InvalidInput(
            f"{slug!r} cannot name a tenant: use 3 to 40 lowercase letters, digits and hyphens, "
            "starting with a letter and not ending with a hyphen (for example 'acme-research').",
            field="slug",
        )
    if slug in RESERVED_SLUGS or slug.startswith("pg-"):
        raise InvalidInput(f"{slug!r} is reserved; choose another name.", field="slug")
    return slug


def public_tenant_ensure(*, name: str = "Provider") -> Tenant:
    """The public schema's own tenant row and the base domain that reaches it; made once, kept after."""
    base = settings.KLIQUE_BASE_DOMAIN
    with schema_context(get_public_schema_name()), transaction.atomic():
        tenant, _ = Tenant.objects.get_or_create(
            schema_name=get_public_schema_name(), defaults={"slug": "public", "name": name}
        )
        Domain.objects.get_or_create(domain=base, defaults={"tenant": tenant, "is_primary": True})
    return tenant


def tenant_create(
    *, slug: str, name: str, admin_username: str, admin_email: str = "", gpu_share: int | None = None
) -> CreatedTenant:
    """Create a tenant with its schema, domain `<slug>.<base domain>`, a first admin and their token."""
    validate_slug(slug)
    if not admin_username.strip():
        raise InvalidInput("Name the tenant's first admin (admin_username).", field="admin_username")
    if gpu_share is not None and gpu_share < 0:
        raise InvalidInput("gpu_share is a number of whole GPUs, 0 or more.", field="gpu_share")
    address = f"{slug}.{settings.KLIQUE_BASE_DOMAIN}"
    with schema_context(get_public_schema_name()):
        if Tenant.objects.filter(slug=slug).exists() or Domain.objects.filter(domain=address).exists():
            raise Conflict(f"A tenant named {slug!r} already exists.", field="slug")
        schema_name = slug.replace("-", "_")
        sql = template.schema_sql(schema_name)  # None: migrate the new schema instead
        with transaction.atomic():
            tenant = Tenant(schema_name=schema_name, slug=slug, name=name or slug, gpu_share=gpu_share)
            tenant.auto_create_schema = sql is None
            tenant.save(verbosity=0)
            if sql is not None:
                with connection.cursor() as cursor:
                    cursor.execute(sql)
            Domain.objects.create(domain=address, tenant=tenant, is_primary=True)
            with schema_context(tenant.schema_name):
                admin = accounts.user_create(
                    tenant=tenant, username=admin_username, email=admin_email, role=Role.ADMIN
                )
                issued = accounts.token_create(tenant=tenant, user=admin, name="first admin token")
    return CreatedTenant(
        tenant=tenant, address=address, admin_username=admin.username, admin_token=issued.secret
    )


def tenant_update(*, tenant: Tenant, name: str | None = None, gpu_share: int | object | None = ...) -> Tenant:
    """Change a tenant's display name or GPU share (pass gpu_share=None to lift the cap)."""
    if name is not None:
        tenant.name = name
    if gpu_share is not ...:
        if gpu_share is not None and (not isinstance(gpu_share, int) or gpu_share < 0):
            raise InvalidInput("gpu_share is a number of whole GPUs, 0 or more.", field="gpu_share")
        tenant.gpu_share = gpu_share
    with schema_context(get_public_schema_name()):
        tenant.save()
    return tenant


def tenant_suspend(*, tenant: Tenant, reason: str) -> Tenant:
    """Refuse every request to the tenant with `reason` until it is resumed; nothing is deleted."""
    if not reason.strip():
        raise InvalidInput("Say why the tenant is suspended; its users will read it.", field="reason")
    tenant.status = Tenant.Status.SUSPENDED
    tenant.suspended_reason = reason.strip()
    tenant.suspended_at = timezone.now()
    with schema_context(get_public_schema_name()):
        tenant.save(update_fields=["status", "suspended_reason", "suspended_at"])
    return tenant


def tenant_resume(*, tenant: Tenant) -> Tenant:
    tenant.status = Tenant.Status.ACTIVE
    tenant.suspended_reason = ""
    tenant.suspended_at = None
    with schema_context(get_public_schema_name()):
        tenant.save(update_fields=["status", "suspended_reason", "suspended_at"])
    return tenant


def tenant_delete(*, tenant: Tenant) -> None:
    """Drop the tenant's schema and everything in it, its domains and its token index entries."""
    if tenant.schema_name == get_public_schema_name():
        raise InvalidInput("The provider's own public tenant cannot be deleted.")
    with schema_context(get_public_schema_name()), transaction.atomic():
        # Deferred foreign-key checks from earlier writes in this transaction would block DROP SCHEMA.
        with connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        tenant.delete()
