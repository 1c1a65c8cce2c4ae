"""Scheduling cycles as Celery tasks, run on events (debounced, see wake.py) and by beat as a safety net;
and the hourly metering of running tasks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings

from apps.scheduling import meter, objectives, webhooks
from apps.scheduling.cycle import run_cycle
from apps.scheduling.selectors import tasks_in_play
from apps.scheduling.wake import CYCLE_TASK, cycle_ended, cycle_starting, send_cycle
from tenants import due
from tenants.tenancy import tenant_task

if TYPE_CHECKING:
    from tenants.models import Tenant


due.predicate("cycle")(tasks_in_play)
due.predicate("objectives")(objectives.measure_due)


@tenant_task(CYCLE_TASK, settles="cycle", autoretry_for=(ConnectionError,), max_retries=3, retry_backoff=True)
def scheduling_cycle(tenant: Tenant) -> dict[str, object]:
    """One cycle for the tenant. Idempotent: a second run on the same state decides nothing new. When
    another worker holds the tenant's cycle, ask for one more afterwards so no event is lost."""
    cycle_starting(tenant.schema_name)  # the requests made while it runs share one cycle after it
    result = run_cycle(tenant)
    if result.ran:
        cycle_ended(tenant.schema_name, result.milliseconds)
    else:
        send_cycle(tenant.schema_name, countdown=settings.KLIQUE_CYCLE_DEBOUNCE_SECONDS)
    return {
        "ran": result.ran,
        "placed": result.placed,
        "preempted": result.preempted,
        "ms": result.milliseconds,
    }


@tenant_task("scheduling.objectives", settles="objectives")
def evaluate_objectives(tenant: Tenant) -> int:
    """Measure the tenant's queue-wait objectives and announce each change of state; then send what is due
    to the tenant's webhooks (new announcements, and retries). How many objectives changed."""
    changed = len(objectives.objectives_evaluate(tenant=tenant))
    webhooks.deliver_due()
    return changed


@tenant_task("metering.running_gpus")
def meter_running(tenant: Tenant) -> int:
    """Running tasks' GPU time up to the last whole hour, into the ledger; how many segments were new."""
    return meter.meter_running()
