"""Periodic metering per tenant (Celery beat sends each through tenants.for_each_tenant)."""

from __future__ import annotations

from apps.metering import runs, services
from tenants.models import Tenant
from tenants.tenancy import tenant_task


@tenant_task("metering.gateway_calls")
def gateway_calls(tenant: Tenant) -> int:
    """The gateway's calls since the last run, into the ledger; how many were new."""
    return services.gateway_calls().accepted


@tenant_task("metering.storage")
def storage(tenant: Tenant) -> int:
    """The last hours of task outputs kept, into the ledger; how many hour-events were new."""
    return services.storage().accepted


@tenant_task("metering.running_gpus")
def running_gpus(tenant: Tenant) -> int:
    """Running tasks' GPU time up to the last whole hour, into the ledger; how many segments were new."""
    return runs.meter_running()
