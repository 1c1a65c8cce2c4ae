"""A task's runs: each dispatch is a run under its own lease, the fencing token of everything its agent
says about it.

A run is live while it is the task's current lease and the task is dispatching or running. It ends with
its result, a refusal, an expired lease, a stop (abort, preempt), or when its agent goes silent or comes
back without it (lost). A lost run is not forgotten: when its agent comes back with it, still running or
finished, and the task has not been dispatched again since, the run is adopted and its result is the
task's; otherwise it is recorded as a duplicate run, its time metered once and flagged, never taken for
the task's result.

These are the run records; what a run's end does to its task (lost, adopted) is lifecycle.py's.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db.models import Count
from django.utils import timezone

from apps.core import deferred
from apps.core.events import publish_event
from apps.resources.models import Pool
from apps.scheduling import wake
from apps.scheduling.meter import meter_segment
from apps.scheduling.models import RunOutcome, Task, TaskEvent, TaskRun, TaskState

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)

LIVE_STATES = (TaskState.DISPATCHING, TaskState.RUNNING)
LOST_REASON = "run_lost"
PREEMPT_GRACE_SECONDS = 30.0  # a preempted run's time to checkpoint before it is killed


def run_begin(task: Task, *, lease: uuid.UUID, pool: Pool, agent_id: str, now: datetime) -> TaskRun:
    """The run a dispatch starts: the task's next attempt, on this agent, under `lease`."""
    (run,) = runs_begin([(task, lease)], pool=pool, agent_id=agent_id, now=now)
    return run


def runs_begin(
    leased: list[tuple[Task, uuid.UUID]], *, pool: Pool, agent_id: str, now: datetime
) -> list[TaskRun]:
    """The runs a dispatch starts, one per (task, lease): each task's next attempt, on this agent. One
    statement numbers the attempts and one inserts the runs, however many there are."""
    counted = TaskRun.objects.filter(task__in=[task for task, _ in leased]).values("task")
    attempts = dict(counted.annotate(runs=Count("pk")).values_list("task", "runs"))
    started = [
        TaskRun(
            lease_id=lease,
            task=task,
            attempt=attempts.get(task.pk, 0) + 1,
            pool=pool,
            agent_id=agent_id,
            size_units=task.size_units,
            dispatched_at=now,
        )
        for task, lease in leased
    ]
    deferred.insert_many(started)  # with the next statement where writes are deferred
    return started


def current_run(task: Task) -> TaskRun | None:
    """The run the task's lease names, locked; None for a task never dispatched."""
    if task.lease_id is None:
        return None
    return TaskRun.objects.select_for_update().filter(pk=task.lease_id, task=task).first()


def is_current(task: Task, run: TaskRun) -> bool:
    return task.lease_id == run.pk and task.state in LIVE_STATES and run.outcome == RunOutcome.LIVE


def reclaimable(task: Task, run: TaskRun) -> bool:
    """Whether a run the plane gave up on (its agent silent, its lease unacknowledged) may be the task's
    again: the task has not been dispatched since (its lease is still this run's), and it waits in the
    queue, or failed only because this run was lost."""
    if task.lease_id != run.pk or run.outcome not in (RunOutcome.LOST, RunOutcome.EXPIRED):
        return False
    if task.state in (TaskState.QUEUED, TaskState.PLACED):
        return True
    return task.state == TaskState.FAILED and task.reason_code == LOST_REASON


def run_started(run: TaskRun | None, now: datetime) -> None:
    if run is not None and run.started_at is None:
        run.started_at = now
        deferred.update_fields(run, ["started_at"])  # locked by the caller with its task


def run_ended(run: TaskRun | None, *, outcome: str, exit_code: int | None, now: datetime) -> None:
    """The run's agent said it ended: it holds nothing of it any more."""
    if run is None:
        return
    run.outcome, run.exit_code, run.ended_at, run.released_at = outcome, exit_code, now, now
    deferred.update_fields(run, ["outcome", "exit_code", "ended_at", "released_at"])  # locked by the caller


def run_ended_aside(tenant: Tenant, task: Task, run: TaskRun, *, body: dict[str, Any], agent_id: str) -> str:
    """A result for a run that is not the task's (a stop it confirms, or a run that went on while the task
    ran again elsewhere). The run is recorded; the task is not touched. Returns what was recorded."""
    now = timezone.now()
    code = body.get("exit_code") if isinstance(body.get("exit_code"), int) else None
    if run.outcome == RunOutcome.STOPPED or run.stop:
        run_ended(run, outcome=RunOutcome.STOPPED, exit_code=code, now=now)
        run_stop_released(tenant)
        return f"attempt {run.attempt} stopped, as asked"
    unmetered_from = run.ended_at  # where the plane stopped counting it, when it gave it up
    run.outcome, run.exit_code, run.released_at = RunOutcome.DUPLICATE, code, now
    run.note = (
        f"{run.note}; it ran on (agent {agent_id}) while the task ran again, and ended with exit code "
        f"{code} at {now:%H:%M:%S} UTC: a duplicate run, metered, not the task's result"
    ).lstrip("; ")
    run.ended_at = now
    run.save()
    if run.started_at is not None and unmetered_from is not None and unmetered_from < now:
        pool = run.pool
        task.pool = pool  # the duplicate's GPUs were in its own pool
        meter_segment(task, started_at=max(unmetered_from, run.started_at), ended_at=now)
    TaskEvent.objects.create(
        task=task, at=now, actor=f"agent {agent_id}"[:200], from_state=task.state, to_state=task.state,
        message=f"duplicate run: attempt {run.attempt} ended with exit code {code} on agent {agent_id} "
        "after the task was run again; metered, not taken as the task's result",
    )  # fmt: skip
    logger.warning(
        "task %s: attempt %s ran twice (agent %s); recorded as a duplicate", task.pk, run.attempt, agent_id
    )
    publish_event(
        tenant=tenant,
        kind="run.duplicate",
        data={"task": str(task.pk), "attempt": run.attempt, "agent": agent_id},
    )
    return f"attempt {run.attempt} recorded as a duplicate run"


def run_stop_released(tenant: Tenant) -> None:
    """A stopped run's agent let it go: its GPUs are free from now (the cycle counted them as held), so
    the tasks waiting for them (the preemptor, the queue behind an abort) are placed now, not at the next
    safety-net cycle."""
    wake.request_cycle(tenant)


def run_request_stop(task: Task, *, kind: str, grace_seconds: float = 0.0) -> TaskRun | None:
    """Desired state: the task's live run is to be stopped (abort or preempt). The plane asks the agent
    until the agent no longer holds the run; the run's GPUs count as used until then."""
    run = current_run(task)
    if run is None or run.outcome != RunOutcome.LIVE:
        return None
    run.stop, run.stop_grace_seconds = kind, grace_seconds
    run.outcome, run.ended_at = RunOutcome.STOPPED, timezone.now()
    run.save(update_fields=["stop", "stop_grace_seconds", "outcome", "ended_at"])
    return run
