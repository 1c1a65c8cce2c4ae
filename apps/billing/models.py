"""The provider's billing, in the public schema: each tenant's Stripe customer, and every usage push."""

from __future__ import annotations

from django.db import models

from tenants.models import Tenant


class StripeCustomer(models.Model):
    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="stripe_customer")
    customer_id = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.tenant_id}: {self.customer_id}"


class StripePush(models.Model):
    """One tenant's usage of one kind for one month, to be sent to Stripe exactly once: made pending when
    the month is exported, sent (with its idempotency key, so a retry after a lost answer is harmless),
    retried while Stripe cannot be reached, failed with Stripe's reason when Stripe refuses it."""

    class Status(models.TextChoices):
        PENDING = "pending"
        SENT = "sent"
        FAILED = "failed"

    class Mode(models.TextChoices):
        METER_EVENT = "meter_event"  # Stripe Billing meters (usage-based prices)
        INVOICE_ITEM = "invoice_item"  # an amount on the next invoice, where meters are not used

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="stripe_pushes")
    period = models.DateField()
    kind = models.CharField(max_length=10)  # gpu, tokens, storage
    quantity = models.DecimalField(max_digits=30, decimal_places=6)  # GPU-hours, tokens, GB-hours
    amount_cents = models.BigIntegerField()
    idempotency_key = models.CharField(max_length=200, unique=True)
    mode = models.CharField(max_length=20, choices=Mode.choices)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    stripe_id = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["period", "tenant_id", "kind"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "period", "kind"], name="one_push_per_tenant_month_kind"
            )
        ]

    def __str__(self) -> str:
        return self.idempotency_key


class ProviderPriceBook(models.Model):
    """What the provider charges its tenants (one row, pk 1), in USD: per GPU-hour by GPU class, per
    million tokens by model ("*" for any other, either way), per GB-month (30 days). A tenant's own price
    book prices its internal chargeback; it never decides what the provider invoices."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    gpu_hour = models.JSONField(default=dict)  # {"H100": "2.50", "*": "1.00"}
    tokens_million = models.JSONField(default=dict)  # {"*": {"in": "0.15", "out": "0.60"}}
    gb_month = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return "provider price book"
