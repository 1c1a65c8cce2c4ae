"""Periodic work of the fleet per tenant (beat sends it to the tenants marked for it: tenants/due.py)."""

from __future__ import annotations

from apps.fleet import outputs
from tenants import due
from tenants.models import Tenant
from tenants.tenancy import tenant_task

due.predicate("storage")(outputs.outputs_to_meter)


@tenant_task("metering.storage", settles="storage")
def meter_outputs(tenant: Tenant) -> int:
    """The last hours of task outputs kept, into the ledger; how many hour-events were new."""
    return outputs.meter_outputs().accepted
