"""The Django side of a scheduling cycle: snapshot, engine, and every decision written in one transaction.

A per-tenant PostgreSQL advisory lock, taken inside the transaction, keeps two workers from scheduling one
tenant at once; the conditional update (`WHERE state = 'queued'`) is a second guard, so a task is placed
at most once whatever happens.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from django.db import connection, transaction
from django.db.models import Sum
from django.utils import timezone

from apps.core.events import publish_event
from apps.resources.models import (
    MIG_METHODS,
    ComputeResource,
    Pool,
    ResourcePolicy,
    ResourceProfile,
    SharingMethod,
)
from apps.scheduling import engine, lifecycle, wake
from apps.scheduling.agents import agents
from apps.scheduling.models import ACTIVE_STATES, Task, TaskRun, TaskState
from apps.scheduling.runs import LOST_REASON
from gateway.wallets import spent_budgets

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CycleResult:
    ran: bool  # False: another worker holds this tenant's cycle
    queued: int = 0
    placed: int = 0
    preempted: int = 0
    milliseconds: float = 0.0


def _lock_key(schema_name: str) -> int:
    return zlib.crc32(f"klique-cycle:{schema_name}".encode())


def _stopping_units() -> dict[str, int]:
    """Units still held per pool by runs the plane has stopped (aborted, preempted) whose connected agent
    has not yet let them go: their GPUs are free only when the agent says so."""
    connected = agents().connected()
    rows = (
        TaskRun.objects.filter(released_at=None, agent_id__in=connected)
        .exclude(stop="")
        .values("pool_id")
        .annotate(units=Sum("size_units"))
    )
    return {str(row["pool_id"]): row["units"] for row in rows if row["pool_id"] is not None}


def _engine_pool(pool: Pool, now: datetime, stopping: int = 0, refusing: bool = False) -> engine.Pool:
    sharing = {engine.Sharing.WHOLE}
    if SharingMethod.FRACTION in pool.sharing:
        sharing.add(engine.Sharing.FRACTION)
    if MIG_METHODS & set(pool.sharing):
        sharing.add(engine.Sharing.MIG)
    return engine.Pool(
        str(pool.pk),
        max(0, pool.capacity_gpus * engine.UNITS_PER_GPU - stopping),
        pool.is_online(now) and not refusing,
        frozenset(sharing),
        pool.name,
    )


Shown = dict[str, tuple[str, str]]  # a queued task's id -> the reason code and text it shows now


_SHARING = {sharing.value: sharing for sharing in engine.Sharing}

# The snapshot's two large reads, as plain rows: ids as text and times as epoch seconds, as the engine
# takes them. Django's rows, UUIDs and time zones cost more than the rest of a cycle at a deep queue
# (a 5,000-task queue read in a quarter to a half of the time).
_QUEUED = f"""
SELECT id::text, compute_resource_id::text, size_units, extract(epoch FROM submitted_at)::float8, sharing,
       priority, time_limit_seconds, reason_code, reason
  FROM {Task._meta.db_table}
 WHERE state = %s AND compute_resource_id IS NOT NULL
"""  # noqa: S608 (the model's own table; every value is a parameter)
_RUNNING = f"""
SELECT id::text, compute_resource_id::text, pool_id::text, size_units,
       extract(epoch FROM coalesce(started_at, placed_at))::float8, extract(epoch FROM started_at)::float8,
       time_limit_seconds
  FROM {Task._meta.db_table}
 WHERE state = ANY(%s) AND pool_id IS NOT NULL
"""  # noqa: S608 (the model's own table; every value is a parameter)


def snapshot(
    tenant: Tenant, now: datetime, *, held: frozenset[str] = frozenset()
) -> tuple[engine.Snapshot, Shown]:
    """The tenant's state as the engine sees it (without the queued tasks in `held`), and the reasons its
    queued tasks show now (read in the same pass, so the cycle writes only the reasons that changed).
    Call inside the cycle's transaction."""
    profiles = []
    for profile in ResourceProfile.objects.prefetch_related("pool_order"):
        order = list(profile.pool_order.all())
        profiles.append(
            engine.Profile(
                str(profile.pk),
                tuple(str(entry.pool_id) for entry in order),
                {str(entry.pool_id): entry.execution_priority for entry in order},
                profile.strict_fifo,
                float(profile.starvation_seconds) if profile.starvation_seconds else None,
            )
        )
    queued = []
    shown: Shown = {}
    with connection.cursor() as cursor:
        cursor.execute(_QUEUED, [TaskState.QUEUED])
        for key, resource, size, submitted, sharing, priority, limit, code, reason in cursor.fetchall():
            if key in held:
                continue
            queued.append(engine.Task(key, resource, size, submitted, _SHARING[sharing], priority, limit))
            shown[key] = (code, reason)
        cursor.execute(_RUNNING, [list(ACTIVE_STATES)])
        running = tuple(
            engine.Allocation(
                key,
                resource,
                pool,
                size,
                begun if begun is not None else now.timestamp(),
                # A run not started yet ends its limit after it starts, at the earliest now.
                None if limit is None else (started if started is not None else now.timestamp()) + limit,
            )
            for key, resource, pool, size, begun, started, limit in cursor.fetchall()
        )
    stopping = _stopping_units()
    refusing = agents().refusing()  # an autoscaler that cannot start instances: its pool takes no work
    state = engine.Snapshot(
        now=now.timestamp(),
        pools=tuple(
            _engine_pool(pool, now, stopping.get(str(pool.pk), 0), str(pool.pk) in refusing)
            for pool in Pool.objects.all()
        ),
        profiles=tuple(profiles),
        policies=tuple(
            engine.Policy(str(pk), reservation, limit, name)
            for pk, reservation, limit, name in ResourcePolicy.objects.values_list(
                "pk", "reservation_units", "limit_units", "name"
            )
        ),
        queues=tuple(
            engine.Queue(str(pk), str(policy), str(profile), priority)
            for pk, policy, profile, priority in ComputeResource.objects.values_list(
                "pk", "policy_id", "profile_id", "queuing_priority"
            )
        ),
        queued=tuple(queued),
        running=running,
        tenant_share=None if tenant.gpu_share is None else tenant.gpu_share * engine.UNITS_PER_GPU,
    )
    return state, shown


def _held_by_budgets(now: datetime) -> dict[str, str]:
    """Queued tasks that may not start because a budget in USD they draw from is spent (one wallet pays
    for a project's GPU time and its gateway calls): task id -> the budget's sentence."""
    blocked = spent_budgets(now=now)
    if not (blocked.tenant or blocked.projects or blocked.users):
        return {}
    held = {}
    waiting = Task.objects.filter(state=TaskState.QUEUED).values_list("pk", "submitter_id", "project_id")
    for pk, submitter, project in waiting:
        reason = blocked.reason(user_id=str(submitter), project_id=str(project) if project else None)
        if reason:
            held[str(pk)] = f"Waiting for budget: {reason}"
    return held


def _explain(reasons: dict[str, str], *, code: str) -> None:
    changed = []
    for task in Task.objects.filter(pk__in=list(reasons), state=TaskState.QUEUED).only(
        "reason_code", "reason"
    ):
        if (task.reason_code, task.reason) != (code, reasons[str(task.pk)]):
            task.reason_code, task.reason = code, reasons[str(task.pk)]
            changed.append(task)
    Task.objects.bulk_update(changed, ["reason_code", "reason"], batch_size=2000)


def _tell_agents(tenant: Tenant, decision: engine.Decision, stopped: list[TaskRun]) -> None:
    """After commit: wake the agents of pools that got work, and stop preempted runs (with a grace period
    so they can checkpoint). The stops are desired state on the runs: a heartbeat that still lists one
    is answered with it again."""
    for pool in sorted({placement.pool for placement in decision.placements}):
        wake.notify_pool(tenant=tenant, pool_id=pool, message={"type": "dispatch"})
    for run in stopped:
        wake.notify_pool(
            tenant=tenant,
            pool_id=run.pool_id,
            message={"type": "preempt", "task_id": str(run.task_id), "lease_id": str(run.pk),
                     "grace_seconds": run.stop_grace_seconds},
        )  # fmt: skip


def _apply(decision: engine.Decision, now: datetime, shown: Shown) -> tuple[int, int, list[TaskRun]]:
    """Write the cycle's decision: placements and preemptions through the lifecycle, then the reasons
    the tasks left waiting wait for, where they differ from what the task shows (`shown`, read by the
    snapshot). Only a task still queued takes its reason: one cancelled meanwhile keeps its own."""
    placed = lifecycle.tasks_place(decision.placements, now)
    preempted, stopped = lifecycle.tasks_preempt(decision.preemptions, now)

    changed = [
        Task(pk=pk, reason_code=reason.code, reason=reason.message)
        for pk, reason in decision.reasons.items()
        if pk in shown
        # A run given up (its pool went silent) keeps saying so while the task waits: that is why it waits.
        and shown[pk][0] != LOST_REASON
        and shown[pk] != (reason.code, reason.message)
    ]
    Task.objects.filter(state=TaskState.QUEUED).exclude(reason_code=LOST_REASON).bulk_update(
        changed, ["reason_code", "reason"], batch_size=2000
    )
    return placed, preempted, stopped


def run_cycle(tenant: Tenant) -> CycleResult:
    """Schedule one tenant: lock, snapshot, decide, write. Call in the tenant's schema."""
    started = time.perf_counter()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [_lock_key(tenant.schema_name)])
            (locked,) = cursor.fetchone()
        if not locked:
            return CycleResult(ran=False)
        lifecycle.leases_expire()
        lifecycle.tasks_of_silent_pools(tenant=tenant)
        lifecycle.tasks_past_time_limit(tenant=tenant)
        now = timezone.now()
        held = _held_by_budgets(now)
        state, shown = snapshot(tenant, now, held=frozenset(held))
        decision = engine.schedule(state)
        placed, preempted, stopped = _apply(decision, now, shown)
        _explain(held, code="budget_exhausted")
        if placed or preempted:  # one event a cycle, however many tasks it moved
            publish_event(
                tenant=tenant, kind="tasks.scheduled", data={"placed": placed, "preempted": preempted}
            )
        lifecycle.use_publish(tenant)
        _tell_agents(tenant, decision, stopped)
    elapsed = (time.perf_counter() - started) * 1000
    logger.info(
        "scheduling cycle",
        extra={
            "queued": len(state.queued),
            "placed": placed,
            "preempted": preempted,
            "ms": round(elapsed, 1),
        },
    )
    return CycleResult(True, len(state.queued), placed, preempted, elapsed)
