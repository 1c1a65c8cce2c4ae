"""Abstract columns more than one app's tables share. No tables of its own."""

from __future__ import annotations

from django.db import models


class Totals(models.Model):
    """Sums of ledger events: how many, and each amount (numeric, so no sum can overflow). Kept per
    tenant in rollups and for the provider per tenant and day (tenants.models.TenantUsageDay); the metering
    ledger writes both."""

    events = models.BigIntegerField(default=0)
    gpu_unit_ms = models.DecimalField(max_digits=38, decimal_places=0, default=0)
    tokens_in = models.DecimalField(max_digits=38, decimal_places=0, default=0)
    tokens_out = models.DecimalField(max_digits=38, decimal_places=0, default=0)
    byte_ms = models.DecimalField(max_digits=38, decimal_places=0, default=0)
    instance_ms = models.DecimalField(max_digits=38, decimal_places=0, default=0)
    cost_nano_usd = models.DecimalField(max_digits=38, decimal_places=0, default=0)

    class Meta:
        abstract = True
