"""Periodic work of the catalogue per tenant: idle apps stopped, Slurm workers of ended controllers ended
(beat sends it to tenants with tasks in play, which every running app and worker is)."""

from __future__ import annotations

from apps.catalogue import services, slurm
from tenants.models import Tenant
from tenants.tenancy import tenant_task


@tenant_task("catalogue.reclaim_idle")
def reclaim_idle(tenant: Tenant) -> int:
    """Stop the tenant's apps idle past their timeout, and end the Slurm workers whose controller run is
    over; how many of each together."""
    return len(services.apps_reclaim_idle(tenant=tenant)) + len(slurm.workers_sweep(tenant=tenant))
