"""The Django side of a scheduling cycle: what it reads (reads.py, incremental.py), the engine, and every
decision written in one transaction.

A per-tenant PostgreSQL advisory lock, taken inside the transaction, keeps two workers from scheduling one
tenant at once; the conditional update (`WHERE state = 'queued'`) is a second guard, so a task is placed
at most once whatever happens.
"""

from __future__ import annotations

import functools
import logging
import time
import zlib
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from apps.core.events import publish_event
from apps.scheduling import engine, incremental, lifecycle, wake
from apps.scheduling.models import Task, TaskRun, TaskState
from apps.scheduling.reads import Shown
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


def _held_by_budgets(now: datetime) -> dict[str, str]:
    """Queued tasks that may not start because a budget in USD they draw from is spent (one wallet pays
    for a project's GPU time and its gateway calls): task id -> the budget's sentence."""
    blocked = spent_budgets(now=now)
    if not (blocked.tenant or blocked.projects or blocked.users):
        return {}
    held = {}
    waiting = Task.objects.filter(state=TaskState.QUEUED)
    if not blocked.tenant:  # only the tasks of those spent (a deep queue is not read while one user's is)
        waiting = waiting.filter(
            Q(submitter_id__in=list(blocked.users)) | Q(project_id__in=list(blocked.projects))
        )
    for pk, submitter, project in waiting.values_list("pk", "submitter_id", "project_id"):
        reason = blocked.reason(user_id=str(submitter), project_id=str(project) if project else None)
        if reason:
            held[str(pk)] = f"Waiting for budget: {reason}"
    return held


# A cycle's reasons, written in one statement however many tasks wait: only to tasks still queued, only where
# they differ from what the task shows, and never over a code in the last array (a run given up keeps saying
# so while its task waits). Django's `bulk_update` writes a CASE per batch, which costs quadratic time in
# the batch: 100,000 reasons took about a minute.
_REASONS = f"""
UPDATE {Task._meta.db_table} AS task SET reason_code = given.code, reason = given.reason
  FROM unnest(%s::uuid[], %s::text[], %s::text[]) AS given(id, code, reason)
 WHERE task.id = given.id AND task.state = %s AND NOT task.reason_code = ANY(%s::text[])
   AND (task.reason_code, task.reason) IS DISTINCT FROM (given.code, given.reason)
"""  # noqa: S608 (the model's own table; every value is a parameter)


def reasons_write(reasons: dict[str, tuple[str, str]], *, keep: tuple[str, ...] = ()) -> int:
    """Give queued tasks their reasons (task id -> code and text), except tasks showing a code in `keep`;
    how many rows changed."""
    if not reasons:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            _REASONS,
            [
                list(reasons),
                [code for code, _ in reasons.values()],
                [text for _, text in reasons.values()],
                TaskState.QUEUED,
                list(keep),
            ],
        )
        return int(cursor.rowcount)


def _explain(reasons: dict[str, str], *, code: str, shown: Shown) -> None:
    """Give held tasks the reason they are held for (`shown`, what the tasks show, is brought up to date)."""
    given = {pk: (code, reason) for pk, reason in reasons.items()}
    reasons_write(given)
    shown.update((pk, reason) for pk, reason in given.items() if pk in shown)


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
    snapshot, which this brings up to date). Only a task still queued takes its reason: one cancelled
    meanwhile keeps its own."""
    placed = lifecycle.tasks_place(decision.placements, now)
    preempted, stopped = lifecycle.tasks_preempt(decision.preemptions, now)
    given = {
        pk: (reason.code, reason.message)
        for pk, reason in decision.reasons.items()
        # A run given up (its pool went silent) keeps saying so while the task waits: that is why it waits.
        if pk in shown and shown[pk][0] != LOST_REASON and shown[pk] != (reason.code, reason.message)
    }
    reasons_write(given, keep=(LOST_REASON,))
    shown.update(given)
    for placement in decision.placements:
        shown.pop(placement.task, None)
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
        outcome = incremental.decide(tenant, now, frozenset(held))
        decision = outcome.decision
        placed, preempted, stopped = _apply(decision, now, outcome.shown)
        # Kept once this commits (what a rollback undoes must not be kept).
        transaction.on_commit(functools.partial(incremental.keep, tenant.schema_name, outcome.kept))
        _explain(held, code="budget_exhausted", shown=outcome.shown)
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
            "queued": outcome.queued,
            "placed": placed,
            "preempted": preempted,
            "ms": round(elapsed, 1),
        },
    )
    return CycleResult(True, outcome.queued, placed, preempted, elapsed)
