"""The one owner of a task's state: every change of `Task.state` is made here, and nowhere else.

Submission (services), the agent protocol (apps.fleet), provisioning (apps.configuration), the scheduling
cycle and metering call down into it; it calls only models, the run records (runs.py), run metering
(meter.py, into apps.metering.runs), the request for a cycle and the pools' agents (wake.py).

    queued -> placed -> dispatching -> running -> completed | failed | aborted
    placed, dispatching, running -> preempted -> queued (at the front of its queue)
    placed, dispatching -> queued (its lease expired, its agent refused it or went silent)
    dispatching -> dispatching (a cloud pool's autoscaler handed it on to an instance: a new run and lease)
    a failed attempt with attempts left -> queued (a retry: a new run of the same task)

A run that ends is metered in the transaction that ends it (`transition`, `tasks_preempt`): its GPU time
reaches the ledger once, whoever ends it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.db.models import DurationField, ExpressionWrapper, F, Q, Value
from django.utils import timezone
from django_tenants.utils import get_public_schema_name

from apps.accounts.models import User
from apps.core import deferred
from apps.core.errors import InvalidInput
from apps.core.events import publish_event, publish_here
from apps.resources.models import SCALES_FROM_ZERO, ComputeResource, Pool, online
from apps.scheduling import engine, wake
from apps.scheduling.agents import agents
from apps.scheduling.meter import meter_run, segments_together
from apps.scheduling.models import (
    ACTIVE_STATES,
    ENDED_STATES,
    RunOutcome,
    Task,
    TaskEvent,
    TaskRun,
    TaskState,
)
from apps.scheduling.runs import (
    LIVE_STATES,
    LOST_REASON,
    PREEMPT_GRACE_SECONDS,
    current_run,
    run_begin,
    run_request_stop,
    runs_begin,
)
from gateway import services as gateway

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)

SCHEDULER = "scheduler"
IN_A_RUN = frozenset({TaskState.DISPATCHING, TaskState.RUNNING})  # states in which a run's lease is live
TIME_LIMIT_REASON = "time_limit"

# Which state may follow which. PREEMPTED passes straight on to QUEUED (at the front of the queue).
TRANSITIONS: dict[str, frozenset[str]] = {
    TaskState.QUEUED: frozenset({TaskState.PLACED, TaskState.ABORTED}),
    TaskState.PLACED: frozenset(
        {TaskState.DISPATCHING, TaskState.QUEUED, TaskState.PREEMPTED, TaskState.ABORTED, TaskState.FAILED}
    ),
    TaskState.DISPATCHING: frozenset(
        {TaskState.RUNNING, TaskState.QUEUED, TaskState.PREEMPTED, TaskState.ABORTED, TaskState.FAILED}
    ),
    TaskState.RUNNING: frozenset(
        {TaskState.COMPLETED, TaskState.FAILED, TaskState.ABORTED, TaskState.PREEMPTED}
    ),
    TaskState.PREEMPTED: frozenset({TaskState.QUEUED}),
}


def _record(task: Task, *, to_state: str, actor: str, message: str, at: datetime) -> TaskEvent:
    return TaskEvent(task=task, at=at, actor=actor, from_state=task.state, to_state=to_state, message=message)


def transition(
    task: Task, *, to_state: str, actor: str, message: str = "", locked: bool = False, **fields: Any
) -> Task:
    """Move a task to `to_state` if its lifecycle allows it, recording who, what and when. A running run
    that ends here is metered (meter.py, into apps.metering.runs) in the same transaction. `locked`: the
    caller read `task` with its row locked in this transaction, so it is the row as it stands."""
    if to_state not in TRANSITIONS.get(task.state, frozenset()):
        raise InvalidInput(f"Task {task.pk} is {task.state}; it cannot become {to_state}.")
    now = timezone.now()
    # Written with the next statement where writes are deferred (an agent's burst, apps.core.deferred):
    # the task's row is locked by the caller, and nothing reads these writes back before then.
    deferred.insert(
        TaskEvent(task=task, at=now, actor=actor, from_state=task.state, to_state=to_state, message=message)
    )
    # Only the columns a transition changes are written: the whole row (its spec among them) cost a
    # third of a report's time, and a caller's other changes to `task` in memory are not a transition's.
    changed = {"state", *fields}
    if task.state == TaskState.RUNNING and task.started_at is not None:
        meter_run(task, ended_at=now, current=locked)
        changed.add("metered_until")
    spec = task.spec or {}
    if task.state in IN_A_RUN and to_state not in IN_A_RUN and "gateway_session" in spec:
        gateway.session_close(task.pk)  # the run's gateway key dies with it (protocol.sessions)
    if to_state in ENDED_STATES and "app" in spec:
        gateway.selfhosted_ended(task.pk)  # a model the app served leaves the gateway, unless asleep
    task.state = to_state
    for name, value in fields.items():
        setattr(task, name, value)
    if to_state in ENDED_STATES:
        task.ended_at = now
        changed.add("ended_at")
    if to_state == TaskState.RUNNING:
        task.metered_until = None  # a new run: nothing of it is metered yet
        changed.add("metered_until")
    deferred.update_fields(task, sorted(changed))
    publish_here(kind=f"task.{to_state}", data={"id": str(task.pk)})
    return task


@transaction.atomic(savepoint=False)  # no savepoint when nested: a failure undoes the caller's too
def task_finish(
    *,
    tenant: Tenant,
    task: Task,
    succeeded: bool,
    exit_code: int | None,
    actor: str,
    lost: str = "",
    detail: str = "",
    locked: bool = False,
) -> Task:
    """Record a run's end. A failed run is queued again while attempts remain (retry policy). `lost` says
    why a run that never reported its end was given up (its pool went silent); `detail` is its agent's word
    on a failure outside the task's own command (its image is not on the host): the task's reason keeps
    either. `locked`: the caller read `task` with its row locked in this transaction, so it is current."""
    if not locked:
        task = Task.objects.select_for_update().get(pk=task.pk)
    how = f"was lost ({lost})" if lost else f"failed with exit code {exit_code}"
    if detail and not lost:
        how += f" ({detail.rstrip('.')})"
    if succeeded:
        transition(task, to_state=TaskState.COMPLETED, actor=actor, locked=True, exit_code=exit_code)
    elif task.attempts < task.max_attempts:
        attempt = f"attempt {task.attempts} {how}"
        transition(task, to_state=TaskState.FAILED, actor=actor, locked=True, message=attempt)
        # A retry is a new run of the same task: it re-enters the queue, keeping its place by submit time.
        TaskEvent.objects.create(
            task=task,
            at=timezone.now(),
            actor=SCHEDULER,
            from_state=TaskState.FAILED,
            to_state=TaskState.QUEUED,
            message=f"retry {task.attempts + 1} of {task.max_attempts}",
        )
        Task.objects.filter(pk=task.pk).update(
            state=TaskState.QUEUED,
            pool=None,
            queued_at=timezone.now(),
            ended_at=None,
            exit_code=exit_code,
            reason_code=LOST_REASON if lost else "retrying",
            reason=f"Attempt {task.attempts} {how}; queued again.",
        )
        task.refresh_from_db()
    else:
        transition(
            task,
            to_state=TaskState.FAILED,
            actor=actor,
            locked=True,
            exit_code=exit_code,
            reason_code=LOST_REASON if lost else "failed",
            reason=f"All {task.max_attempts} attempts failed; the last {how}.",
        )
    freed = _freed.get()
    if freed is None:
        _gpus_freed(tenant)
    else:
        freed.setdefault(tenant.pk, tenant)  # decided once, when the block of runs ending together ends
    return task


_freed: ContextVar[dict[Any, Tenant] | None] = ContextVar("klique_gpus_freed", default=None)


@contextmanager
def ending_together() -> Iterator[None]:
    """Runs that end within the block (an agent's burst of results) end together: their GPU segments go
    to the ledger in one write (meter.segments_together), and what their GPUs go to next is decided once,
    after them all (`_gpus_freed`), not once per run. Open it inside the transaction that ends the runs and
    let it end before that transaction commits; a block left by an exception does neither, as that
    transaction is undone. Within a block already open, it is that block's."""
    if _freed.get() is not None:
        yield
        return
    freed: dict[Any, Tenant] = {}
    opened = _freed.set(freed)
    try:
        with segments_together():
            yield
    finally:
        _freed.reset(opened)
    for tenant in freed.values():
        _gpus_freed(tenant)


def _gpus_freed(tenant: Tenant) -> None:
    """Runs of the tenant ended: their GPUs go to the work that waits (a cycle), or, where nothing waits,
    the tenant's GPUs in use are shown as they now are (a cycle would only have said that)."""
    if Task.objects.filter(state=TaskState.QUEUED).exists():
        wake.request_cycle(tenant)
    else:
        use_publish(tenant)


def use_publish(tenant: Tenant) -> None:
    """The GPUs the tenant's work holds now, on its public row for the provider's pages. Written only
    where it changed (read with the sum): a cycle at rest then writes nothing, and its commit waits for
    no flush of the write-ahead log."""
    row = type(tenant)._meta
    public = (
        f"{connection.ops.quote_name(get_public_schema_name())}.{connection.ops.quote_name(row.db_table)}"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT coalesce(sum(size_units), 0), (SELECT gpu_units_in_use FROM {public} WHERE id = %s) "  # noqa: S608 -- names
            f"FROM {Task._meta.db_table} WHERE state = ANY(%s)",
            [tenant.pk, list(ACTIVE_STATES)],
        )
        held, shown = cursor.fetchone()
    if held != shown:
        type(tenant).objects.filter(pk=tenant.pk).update(gpu_units_in_use=held)


def tasks_end_for_removed_resources(*, resources: list[ComputeResource], actor: User) -> int:
    """End the queued tasks of compute resources that provisioning removes, saying so. Returns how many."""
    now = timezone.now()
    ended = 0
    for resource in resources:
        queued = list(Task.objects.filter(compute_resource=resource, state=TaskState.QUEUED))
        message = (
            f"Its compute resource {resource.name} was removed by {actor.username} "
            f"on {now:%Y-%m-%d %H:%M} UTC."
        )
        TaskEvent.objects.bulk_create(
            _record(task, to_state=TaskState.ABORTED, actor=actor.username, message=message, at=now)
            for task in queued
        )
        ended += Task.objects.filter(pk__in=[task.pk for task in queued]).update(
            state=TaskState.ABORTED, ended_at=now, reason_code="compute_resource_removed", reason=message
        )
    return ended


@transaction.atomic(savepoint=False)  # no savepoint when nested: a failure undoes the caller's too
def leases_expire() -> int:
    """Tasks handed out but not acknowledged in time go back to the queue. Returns how many."""
    now = timezone.now()
    expired = Task.objects.filter(state=TaskState.DISPATCHING, lease_expires_at__lt=now)
    count = 0
    for task in expired.select_for_update(skip_locked=True):
        TaskRun.objects.filter(task=task, lease_id__in=[task.lease_id], outcome=RunOutcome.LIVE).update(
            outcome=RunOutcome.EXPIRED, ended_at=now, note="its agent did not acknowledge it in time"
        )  # kept: the agent may still say it runs it, and it is the task's again if nothing ran since
        transition(
            task,
            to_state=TaskState.QUEUED,
            actor=SCHEDULER,
            message="lease expired",
            pool=None,
            lease_expires_at=None,
            queued_at=now,
            reason_code="lease_expired",
            reason="Its agent did not acknowledge it in time; queued again.",
        )
        count += 1
    return count


def tasks_past_time_limit(*, tenant: Tenant, now: datetime | None = None) -> int:
    """Stop every run that has reached its task's time limit the way a preemption is stopped (SIGTERM,
    the grace period to checkpoint, then SIGKILL) and end the task failed, saying so: not retried, since a
    retry would meet the same limit. Its GPU time is metered to now. Returns how many."""
    now = now or timezone.now()
    limit = ExpressionWrapper(
        F("time_limit_seconds") * Value(timedelta(seconds=1)), output_field=DurationField()
    )
    due = (
        Task.objects.select_for_update(skip_locked=True)
        .filter(state=TaskState.RUNNING, time_limit_seconds__isnull=False, started_at__isnull=False)
        .alias(deadline=F("started_at") + limit)
        .filter(deadline__lte=now)
    )
    stopped = 0
    for task in due:
        run = run_request_stop(task, kind="preempt", grace_seconds=PREEMPT_GRACE_SECONDS)
        if run is not None:
            wake.notify_pool(
                tenant=tenant,
                pool_id=run.pool_id,
                message={"type": "preempt", "task_id": str(task.pk), "lease_id": str(run.pk),
                         "grace_seconds": PREEMPT_GRACE_SECONDS},
            )  # fmt: skip
        limit_text = engine.describe_seconds(task.time_limit_seconds or 0)
        transition(
            task,
            to_state=TaskState.FAILED,
            actor=SCHEDULER,
            message=f"stopped at its time limit of {limit_text}",
            reason_code=TIME_LIMIT_REASON,
            reason=(
                f"Stopped at its time limit of {limit_text}, with {PREEMPT_GRACE_SECONDS:.0f} s to "
                "checkpoint first; not retried. Give it a longer time_limit_seconds (its compute resource's "
                "profile sets the most) to let it finish."
            ),
        )
        stopped += 1
    if stopped:
        wake.request_cycle(tenant)  # its GPUs free once its agent lets go of the run
    return stopped


def run_hand_on(
    task: Task, run: TaskRun, *, agent_id: str, patience_seconds: float, actor: str, reason: str
) -> TaskRun:
    """The task's current run, held by its cloud pool's autoscaler, ends handed on; the task goes on in a new
    run under a new lease on `agent_id` (an instance's agent), which must accept it within the patience or
    the task is queued again (leases_expire). Call with the task locked. Returns the new run."""
    now = timezone.now()
    run.outcome, run.ended_at, run.released_at = RunOutcome.HANDED, now, now
    run.note = f"handed on to {agent_id} at {now:%H:%M:%S} UTC"
    run.save(update_fields=["outcome", "ended_at", "released_at", "note"])
    lease = uuid.uuid4()
    pool = run.pool or task.pool
    assert pool is not None, "a run handed on is in its pool"
    following = run_begin(task, lease=lease, pool=pool, agent_id=agent_id, now=now)
    TaskEvent.objects.create(
        task=task, at=now, actor=actor[:200], from_state=task.state, to_state=task.state,
        message=f"attempt {run.attempt} handed on to {agent_id}: attempt {following.attempt}, lease {lease}",
    )  # fmt: skip
    task.lease_id, task.lease_expires_at = lease, now + timedelta(seconds=patience_seconds)
    task.reason_code, task.reason = "starting_instance", reason[:1000]
    task.save(update_fields=["lease_id", "lease_expires_at", "reason_code", "reason"])
    return following


@transaction.atomic
def runs_interrupted(tenant: Tenant, *, pool: Pool, agent_id: str, why: str) -> list[TaskRun]:
    """The cloud took back, or is about to take back, the instance `agent_id` of `pool` runs on (a spot
    interruption, an instance that vanished): every task starting or running there goes back to the front
    of its queue as preempted, its run asked to stop with the grace period to checkpoint (moot where the
    instance is gone) and its GPU time so far metered. Returns the runs to stop."""
    message = f"Preempted: {why}; back at the front of its queue."
    live = TaskRun.objects.filter(agent_id=agent_id, pool=pool, outcome=RunOutcome.LIVE).values("task_id")
    preempting = _Preempting(timezone.now())
    for task in Task.objects.select_for_update(of=("self",)).filter(pk__in=live, state__in=LIVE_STATES):
        run = current_run(task)
        if run is not None and run.agent_id == agent_id and run.pool_id == pool.pk:
            preempting.preempt(task, message)
    preempting.finish()
    stopped = preempting.stopped
    for run in stopped:
        wake.notify_pool(
            tenant=tenant, pool_id=run.pool_id,
            message={"type": "preempt", "task_id": str(run.task_id), "lease_id": str(run.pk),
                     "grace_seconds": run.stop_grace_seconds},
        )  # fmt: skip
    if stopped:
        logger.warning("agent %s: %d runs preempted: %s", agent_id, len(stopped), why)
        publish_event(
            tenant=tenant,
            kind="tasks.interrupted",
            data={"agent": agent_id, "runs": len(stopped), "why": why},
        )
        wake.request_cycle(tenant)
    return stopped


def run_lost(tenant: Tenant, task: Task, why: str) -> None:
    """The task's run is gone from the plane's view (its agent silent, or back without it): a run that
    never started goes back to the queue; a started run counts as a failed attempt, retried while
    attempts remain. The run is kept as lost, so that its agent may still bring it back."""
    now = timezone.now()
    run = current_run(task)
    if run is not None:
        run.outcome, run.ended_at = RunOutcome.LOST, now
        run.note = f"lost at {now:%H:%M:%S} UTC: {why}"
        run.save(update_fields=["outcome", "ended_at", "note"])
    attempt = f"attempt {run.attempt}" if run is not None else "its run"
    if task.state == TaskState.DISPATCHING:
        transition(
            task,
            to_state=TaskState.QUEUED,
            actor=SCHEDULER,
            message=f"{attempt} lost: {why}",
            pool=None,
            lease_expires_at=None,
            queued_at=now,
            reason_code="lease_lost",
            reason=f"Its dispatch was lost ({why}); queued again.",
        )
    else:
        task_finish(tenant=tenant, task=task, succeeded=False, exit_code=None, actor=SCHEDULER, lost=why)
    pool = run.pool.name if run is not None and run.pool else "?"
    agent = run.agent_id if run is not None else ""
    logger.warning("task %s: %s on pool %s (agent %s) lost: %s", task.pk, attempt, pool, agent or "?", why)
    publish_event(
        tenant=tenant,
        kind="run.lost",
        data={"task": str(task.pk), "pool": pool, "agent": agent, "why": why},
    )


def run_adopt(tenant: Tenant, task: Task, run: TaskRun, *, agent_id: str, ended: bool) -> None:
    """The agent came back with a run the plane had given up on, and the task has not run since: the run
    is the task's again (running, or with its result on the way), not started a second time."""
    now = timezone.now()
    to_state = TaskState.RUNNING if run.started_at is not None else TaskState.DISPATCHING
    how = "its result on the way" if ended else "still running"
    message = f"adopted: agent {agent_id} came back with attempt {run.attempt}, {how}; not run again"
    TaskEvent.objects.create(
        task=task, at=now, actor=f"agent {agent_id}"[:200], from_state=task.state, to_state=to_state,
        message=message,
    )  # fmt: skip
    task.state, task.pool_id, task.started_at = to_state, run.pool_id, run.started_at
    task.lease_expires_at, task.ended_at, task.exit_code = None, None, None
    task.reason_code, task.reason = (
        "adopted",
        f"Attempt {run.attempt} was adopted when agent {agent_id} came back.",
    )
    task.save()
    run.outcome, run.ended_at, run.agent_id = RunOutcome.LIVE, None, agent_id
    run.note = f"{run.note}; adopted at {now:%H:%M:%S} UTC".lstrip("; ")
    run.save(update_fields=["outcome", "ended_at", "agent_id", "note"])
    logger.info("task %s: attempt %s adopted from agent %s (%s)", task.pk, run.attempt, agent_id, how)
    publish_event(
        tenant=tenant,
        kind="run.adopted",
        data={"task": str(task.pk), "attempt": run.attempt, "agent": agent_id, "ended": ended},
    )


@transaction.atomic(savepoint=False)  # no savepoint when nested: a failure undoes the caller's too
def tasks_of_silent_pools(*, tenant: Tenant) -> int:
    """Runs dispatched to or running in a pool whose agents all stopped heartbeating beyond the pool's
    timeout (in a cloud pool each agent is judged alone), or on an agent that did, are lost: a dispatch
    goes back to the queue, a run counts as a failed attempt. Each is kept, to be adopted if its agent
    comes back with it before the task runs again. Returns how many."""
    now = timezone.now()
    # A cloud pool's silence is its autoscaler's: its instances' agents run on, each judged by its own
    # heartbeats (an autoscaler away must not make the work running on live instances look lost).
    silent_pools = {
        pk: name
        for pk, name, last, timeout in Pool.objects.exclude(environment__in=SCALES_FROM_ZERO).values_list(
            "pk", "name", "last_heartbeat_at", "heartbeat_timeout_seconds"
        )
        if not online(last, timeout, now)
    }
    silent_agents = agents().silent(now)
    leases = TaskRun.objects.filter(agent_id__in=silent_agents, outcome=RunOutcome.LIVE).values("pk")
    lost: dict[str, int] = {}
    for task in Task.objects.select_for_update(skip_locked=True, of=("self",)).filter(
        Q(pool_id__in=list(silent_pools)) | Q(lease_id__in=leases), state__in=LIVE_STATES
    ):
        if task.pool_id in silent_pools:
            why = f"pool {silent_pools[task.pool_id]} went silent (no heartbeat for its timeout)"
        else:
            why = "its agent went silent (no heartbeat for the pool's timeout)"
        pool = task.pool.name if task.pool else "?"
        run_lost(tenant, task, why)
        lost[pool] = lost.get(pool, 0) + 1
    for pool, count in lost.items():  # once per loss, not once per cycle the pool stays silent
        logger.warning("pool %s: %d runs given up, their agents silent past the timeout", pool, count)
        publish_event(tenant=tenant, kind="pool.silent", data={"pool": pool, "runs_lost": count})
    return sum(lost.values())


def tasks_place(placements: Iterable[engine.Placement], now: datetime) -> int:
    """A cycle's placements: each queued task into its pool, once, in one statement (its condition, still
    queued, is the guard against a second worker and a cancel meanwhile). Returns how many were placed."""
    wanted = [(placement.task, placement.pool) for placement in placements]
    if not wanted:
        return 0
    rows = ", ".join(["(%s::uuid, %s::uuid)"] * len(wanted))
    table = connection.ops.quote_name(Task._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""UPDATE {table} AS t
                   SET state = %s, pool_id = v.pool, placed_at = %s,
                       wait_seconds = extract(epoch FROM %s - t.queued_at), reason_code = '', reason = ''
                  FROM (VALUES {rows}) AS v(task, pool)
                 WHERE t.id = v.task AND t.state = %s
             RETURNING t.id""",  # noqa: S608 (the table's name is the model's; every value is a parameter)
            [TaskState.PLACED, now, now, *(value for pair in wanted for value in pair), TaskState.QUEUED],
        )
        placed = {str(task) for (task,) in cursor.fetchall()}
    TaskEvent.objects.bulk_create(
        TaskEvent(
            task_id=task,
            at=now,
            actor=SCHEDULER,
            from_state=TaskState.QUEUED,
            to_state=TaskState.PLACED,
            message=f"placed in pool {pool}",
        )
        for task, pool in wanted  # in the cycle's order
        if str(task) in placed
    )
    return len(placed)


def tasks_dispatch(
    tasks: list[Task], *, pool: Pool, agent_id: str, now: datetime, lease_seconds: float
) -> list[TaskRun]:
    """Hand placed tasks, locked by the caller, to an agent: each becomes its next attempt, a run under a
    lease of its own, and waits dispatching for the agent's answer until the lease expires. One statement
    numbers the attempts; the runs, the events and the tasks are written in one message, however many
    there are (a cycle places a pool's freed GPUs at once), with the next statement within
    `deferred.writes_deferred`. Returns each task's run, in order."""
    for task in tasks:
        if TaskState.DISPATCHING not in TRANSITIONS.get(task.state, frozenset()):
            raise InvalidInput(f"Task {task.pk} is {task.state}; it cannot become {TaskState.DISPATCHING}.")
    if not tasks:
        return []
    started = runs_begin([(task, uuid.uuid4()) for task in tasks], pool=pool, agent_id=agent_id, now=now)
    on = f", agent {agent_id}" if agent_id else ""
    deferred.insert_many([
        _record(task, to_state=TaskState.DISPATCHING, actor=SCHEDULER, at=now,
                message=f"attempt {run.attempt}, lease {run.pk}{on}")
        for task, run in zip(tasks, started, strict=True)
    ])  # fmt: skip
    expires = now + timedelta(seconds=lease_seconds)
    for task, run in zip(tasks, started, strict=True):
        task.state, task.lease_id, task.lease_expires_at = TaskState.DISPATCHING, run.pk, expires
    deferred.update_many(tasks, ["state", "lease_id", "lease_expires_at"])
    for task in tasks:
        publish_here(kind=f"task.{TaskState.DISPATCHING}", data={"id": str(task.pk)})
    return started


@dataclass
class _Preempting:
    """What preempting locked tasks gathers: their events, the runs to meter once every row is locked (a
    run's end elsewhere locks its row, then the ledger's rollups; taking the rollups before the last row
    could deadlock with it), and the runs to stop."""

    now: datetime
    events: list[TaskEvent] = field(default_factory=list)
    ran: list[Task] = field(default_factory=list)
    stopped: list[TaskRun] = field(default_factory=list)
    count: int = 0

    def preempt(self, victim: Task, message: str) -> None:
        """The locked task back at the front of its queue (it keeps its submit time), its live run asked
        to stop with the grace period to checkpoint."""
        self.events += [
            _record(victim, to_state=TaskState.PREEMPTED, actor=SCHEDULER, message=message, at=self.now),
            TaskEvent(
                task=victim, at=self.now, actor=SCHEDULER, from_state=TaskState.PREEMPTED,
                to_state=TaskState.QUEUED, message="requeued at its original submit time",
            ),
        ]  # fmt: skip
        if victim.state == TaskState.RUNNING and victim.started_at is not None:
            self.ran.append(victim)
        if victim.state in LIVE_STATES:
            stopping = run_request_stop(victim, kind="preempt", grace_seconds=PREEMPT_GRACE_SECONDS)
            if stopping is not None:
                self.stopped.append(stopping)
        self.count += Task.objects.filter(pk=victim.pk).update(
            state=TaskState.QUEUED, pool=None, queued_at=self.now, placed_at=None, started_at=None,
            lease_expires_at=None, reason_code="preempted", reason=message[:1000],
        )  # fmt: skip

    def finish(self) -> None:
        TaskEvent.objects.bulk_create(self.events)
        with segments_together():  # each preempted run is a segment of its own, all in one write
            for task in self.ran:  # locked when read as victims: their rows as they stand
                meter_run(task, ended_at=self.now, current=True)


def tasks_preempt(preemptions: Iterable[engine.Preemption], now: datetime) -> tuple[int, list[TaskRun]]:
    """A cycle's preemptions: each victim back at the front of its queue, its run asked to stop (with a
    grace period to checkpoint) and metered. Returns how many were preempted and the runs to stop."""
    preempting = _Preempting(now)
    for preemption in preemptions:
        # Locked, so that its state is the one it leaves: a run that ended meanwhile is left alone.
        victim = (
            Task.objects.select_for_update().filter(pk=preemption.victim, state__in=ACTIVE_STATES).first()
        )
        if victim is not None:
            preempting.preempt(
                victim,
                f"Preempted to return borrowed capacity to guaranteed task {preemption.for_task}; "
                "back at the front of its queue.",
            )
    preempting.finish()
    return preempting.count, preempting.stopped
