"""Periodic work of the fleet per tenant (Celery beat sends it through tenants.for_each_tenant)."""

from __future__ import annotations

from apps.fleet import outputs
from tenants.models import Tenant
from tenants.tenancy import tenant_task


@tenant_task("metering.storage")
def meter_outputs(tenant: Tenant) -> int:
    """The last hours of task outputs kept, into the ledger; how many hour-events were new."""
    return outputs.meter_outputs().accepted
