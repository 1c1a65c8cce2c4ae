"""Periodic work of the catalogue per tenant: idle apps stopped (beat sends it to tenants with tasks in
play, which every running app is)."""

from __future__ import annotations

from apps.catalogue import services
from tenants.models import Tenant
from tenants.tenancy import tenant_task


@tenant_task("catalogue.reclaim_idle")
def reclaim_idle(tenant: Tenant) -> int:
    """Stop the tenant's apps idle past their timeout; how many."""
    return len(services.apps_reclaim_idle(tenant=tenant))
