"""Dispatch under a lease, the agent's answer to it, and its reports applied once to the run their lease
names (applied, duplicate or stale)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.utils import timezone

from apps.core import deferred
from apps.core.errors import InvalidInput, NotFound
from apps.core.events import publish_log
from apps.fleet.models import TaskReport
from apps.resources.models import Pool
from apps.scheduling import lifecycle, runs, wake
from apps.scheduling.engine import UNITS_PER_GPU
from apps.scheduling.lifecycle import task_finish, transition
from apps.scheduling.models import ACTIVE_STATES, ENDED_STATES, RunOutcome, Task, TaskRun, TaskState
from apps.vault.services import mask, secret_names_quietly, secret_values_for, secret_values_to_mask
from gateway import services as gateway
from protocol import messages, sessions

if TYPE_CHECKING:
    from tenants.models import Tenant
from apps.fleet.credentials import session_key, task_token
from apps.fleet.errors import AgentRejected, StaleLease
from apps.fleet.selectors import burst_current, burst_report_new, pool_task, pool_task_and_run
from apps.fleet.session import LEASE_SECONDS, agent_alive

logger = logging.getLogger(__name__)


def dispatch(
    *, pool: Pool, schema_name: str, agent_id: str = "", instance: bool = False
) -> list[dict[str, Any]]:
    """Hand the pool's placed tasks to this agent, each as a new run under its own lease; returns the
    assign messages to send. A cloud instance's agent takes no placed task: it gets the runs its pool's
    autoscaler handed on to it, again until it accepts them (they are desired state).

    Asked after every heartbeat of every agent and at every wake of the pool's agents, and nearly always
    with nothing placed: one indexed query answers that, without a transaction. A task placed after it
    looked is announced by the cycle once its placement commits, and that notice asks again."""
    if instance:
        return _handed(pool=pool, schema_name=schema_name, agent_id=agent_id)
    with connection.cursor() as cursor:
        cursor.execute(_ANY_PLACED, [pool.pk, TaskState.PLACED])
        if cursor.fetchone() is None:
            return []
    return _dispatch_placed(pool=pool, schema_name=schema_name, agent_id=agent_id)


_ANY_PLACED = f"SELECT 1 FROM {Task._meta.db_table} WHERE pool_id = %s AND state = %s LIMIT 1"  # noqa: S608 (the model's own table)


@transaction.atomic
def _dispatch_placed(*, pool: Pool, schema_name: str, agent_id: str) -> list[dict[str, Any]]:
    """The placed tasks' runs begun and their assign messages; the runs, events and tasks written with
    the commit's message (apps.core.deferred), not one round trip each."""
    now = timezone.now()
    placed = Task.objects.select_for_update(skip_locked=True, of=("self",)).select_related(
        "compute_resource__profile", "submitter", "project"
    )
    with deferred.writes_deferred():
        secrets = {}
        for task in placed.filter(pool=pool, state=TaskState.PLACED):
            found = _secrets(task, now)
            if found is not None:  # else it failed, saying why
                secrets[task] = found
        ready = list(secrets)
        started = lifecycle.tasks_dispatch(
            ready, pool=pool, agent_id=agent_id, now=now, lease_seconds=LEASE_SECONDS
        )
        return [
            _assign(task, run, schema_name, _with_session(task, schema_name, secrets[task]))
            for task, run in zip(ready, started, strict=True)
        ]


def _with_session(task: Task, schema_name: str, secrets: dict[str, str]) -> dict[str, str]:
    """The run's secrets with its gateway session's key, where its task asks for one (protocol.sessions):
    registered with the gateway under the run's lease, so it dies with the run."""
    try:
        session = sessions.parse((task.spec or {}).get("gateway_session"))
    except sessions.SessionRefused:
        session = None  # checked at submission; a spec changed since gets no key
    if session is None:
        return secrets
    key = session_key(schema_name=schema_name, task=task)
    gateway.session_open(
        task_id=task.pk,
        key=key,
        user=task.submitter,
        project=task.project,
        label=f"session {task.name}",
        tokens=session.tokens,
    )
    return {**secrets, sessions.KEY_VARIABLE: key}


@transaction.atomic
def _handed(*, pool: Pool, schema_name: str, agent_id: str) -> list[dict[str, Any]]:
    """The runs handed on to this instance's agent that it has not accepted yet."""
    now = timezone.now()
    handed = Task.objects.select_for_update(skip_locked=True, of=("self",)).select_related(
        "compute_resource__profile", "submitter", "project"
    )
    assigned = []
    mine = TaskRun.objects.filter(agent_id=agent_id, outcome=RunOutcome.LIVE).values("pk")
    waiting = handed.filter(
        pool=pool, state=TaskState.DISPATCHING, lease_expires_at__isnull=False, lease_id__in=mine
    )
    for task in waiting:
        run = runs.current_run(task)
        if run is None or run.agent_id != agent_id or run.outcome != RunOutcome.LIVE:
            continue
        secrets = _secrets(task, now)
        if secrets is not None:
            assigned.append(_assign(task, run, schema_name, _with_session(task, schema_name, secrets)))
    return assigned


def _secrets(task: Task, now: datetime) -> dict[str, str] | None:
    """The task's secrets for its agent; None when it cannot run as asked (it failed, saying why)."""
    try:
        return secret_values_for(task)  # to the agent only, in this message; read recorded
    except (NotFound, InvalidInput) as missing:  # deleted since, or a name no task may be given
        transition(  # it cannot run as asked: placing it again would fail again
            task,
            to_state=TaskState.FAILED,
            actor="scheduler",
            message=missing.message,
            ended_at=now,
            reason_code="secret_missing" if isinstance(missing, NotFound) else "secret_refused",
            reason=f"{missing.message} Keep it again and resubmit the task.",
        )
        return None


def _assign(task: Task, run: TaskRun, schema_name: str, secrets: dict[str, str]) -> dict[str, Any]:
    details = {
        "name": task.name,
        "spec": task.spec,
        "gpus": str(task.size_units / UNITS_PER_GPU),
        "size_units": task.size_units,
        "nodes": task.nodes,
        "sharing": task.sharing,
        "mig_profile": task.compute_resource.profile.mig_profile if task.compute_resource else "",
        "user": task.submitter.username,
        "project": task.project.name if task.project else "",
        "batch": task.compute_resource.batch if task.compute_resource else {},
        "compute_resource": task.compute_resource.name if task.compute_resource else "",
        "tenant": schema_name,
        "task_token": task_token(schema_name=schema_name, task=task),
        "secrets": secrets,
    }
    return messages.Assign(str(task.pk), str(run.pk), run.attempt, details).as_json()


def _unnamed_run(task: Task | None, agent_id: str) -> TaskRun | None:
    """The run a report naming no lease is about: one an agent started before it spoke of leases (an
    upgrade while tasks ran), which is the task's live run on this agent, or nothing."""
    run = runs.current_run(task) if task is not None else None
    if task is None or run is None or not runs.is_current(task, run) or run.agent_id not in ("", agent_id):
        return None
    return run


@transaction.atomic(savepoint=False)  # no savepoint when nested: the caller isolates messages
def lease_accepted(
    *, tenant: Tenant, pool: Pool, agent_id: str, accepted: messages.Accepted
) -> messages.Stop | None:
    """The agent took the run. A lease that is no longer the task's (expired and dispatched again, or the
    task aborted) is answered with a stop, so the run does not go on beside another; an expired lease of a
    task that waits in the queue still is the task's run again."""
    task, run = pool_task_and_run(accepted.task_id, accepted.lease_id, pool)
    if task is not None and run is not None:
        if runs.is_current(task, run):
            task.lease_expires_at = None
            deferred.update_fields(task, ["lease_expires_at"])  # locked above
            burst_current(task, run, pool)
            return None
        if runs.reclaimable(task, run):
            lifecycle.run_adopt(tenant, task, run, agent_id=agent_id, ended=False)
            agent_alive(tenant, pool, agent_id)
            return None
    raise StaleLease(
        f"No lease {accepted.lease_id} on task {accepted.task_id} in pool {pool.name} is live; it may have "
        "expired or the task ended. Do not run it.",
        messages.Stop("abort", accepted.task_id, accepted.lease_id),
    )


@transaction.atomic(savepoint=False)  # no savepoint when nested: the caller isolates messages
def lease_rejected(*, tenant: Tenant, pool: Pool, rejected: messages.Rejected) -> None:
    """A refused task waits in the queue again, unless the refusal is permanent (a user with no account
    on the cluster, a value no batch script may hold, a partition the cluster lacks): then it fails, with
    the agent's reason, rather than being placed and refused forever. A refusal of a lease that is not
    live changes nothing."""
    task, run = pool_task_and_run(rejected.task_id, rejected.lease_id, pool)
    if task is None or run is None or not runs.is_current(task, run):
        raise StaleLease(
            f"No lease {rejected.lease_id} on task {rejected.task_id} in pool {pool.name} is live; "
            "the refusal changes nothing."
        )
    runs.run_ended(run, outcome=RunOutcome.REFUSED, exit_code=None, now=timezone.now())
    reason = rejected.reason
    if rejected.permanent:
        transition(
            task,
            to_state=TaskState.FAILED,
            actor="agent",
            message=reason,
            ended_at=timezone.now(),
            lease_expires_at=None,
            reason_code="refused",
            reason=f"The agent of pool {pool.name} refused it: {reason}",
        )
        publish_log(tenant=tenant, task_id=str(task.pk), chunk={"type": "end", "state": task.state})
        wake.request_cycle(tenant)
        return
    transition(
        task,
        to_state=TaskState.QUEUED,
        actor="agent",
        message=reason,
        pool=None,
        lease_id=None,
        lease_expires_at=None,
        queued_at=timezone.now(),
        reason_code="rejected_by_agent",
        reason=f"The agent of pool {pool.name} refused it: {reason}",
    )


@transaction.atomic(savepoint=False)  # no savepoint when nested: the caller isolates messages
def report(*, tenant: Tenant, pool: Pool, agent_id: str, message: messages.Report) -> messages.Ack:
    """Apply one report of the pool's agent to the run its lease names, once, and say what became of it:
    applied, a duplicate (its number was seen), or stale (its run is not the task's: refused, expired,
    lost and run again, aborted). A result of a run that is not the task's is recorded beside it (a
    stop it confirms, a duplicate run), never taken as the task's."""
    if message.lease_id:
        task, run = pool_task_and_run(message.task_id, message.lease_id, pool)
    else:
        task = pool_task(message.task_id, pool)
        run = _unnamed_run(task, agent_id)
    ack = partial(messages.Ack, message.task_id, message.lease_id, message.seq)
    if task is None or run is None:
        return ack(
            messages.STALE, f"Task {message.task_id} has no run {message.lease_id} in pool {pool.name}."
        )
    if not runs.is_current(task, run):
        # The current run's reports are kept once by their insert (task_report); any other's are looked up
        # first, so that a replay adopts or records nothing.
        seen = TaskReport.objects.filter(task=task, lease_id=run.pk, source="agent", seq=message.seq)
        if seen.exists():
            return ack(messages.DUPLICATE)
        if runs.reclaimable(task, run):  # e.g. its lease expired unanswered
            ended = message.kind == TaskReport.Kind.RESULT
            lifecycle.run_adopt(tenant, task, run, agent_id=agent_id, ended=ended)
            agent_alive(tenant, pool, agent_id)  # what it reports proves it is there: not lost again
    if not runs.is_current(task, run):
        if message.kind == TaskReport.Kind.RESULT and run.released_at is None:
            return ack(
                messages.STALE, runs.run_ended_aside(tenant, task, run, body=message.body, agent_id=agent_id)
            )
        return ack(messages.STALE, f"Attempt {run.attempt} is not the task's run any more ({task.state}).")
    kept = task_report(
        tenant=tenant, task=task, source="agent", seq=message.seq, kind=message.kind, body=message.body,
        lease=run,
    )  # fmt: skip
    burst_current(task, run, pool)  # task_report changes them in place, and the rows with them
    return ack(messages.APPLIED if kept else messages.DUPLICATE)


MASK_SECONDS = 60.0  # how long a process keeps a task's values to mask before reading them again


_masks: OrderedDict[tuple[str, str], tuple[float, list[str]]] = OrderedDict()


def _masked_values(task: Task) -> list[str]:
    """The values of the task's secrets, kept a minute in this process (log chunks come in bursts); a task
    that names no secret costs nothing."""
    session = "gateway_session" in (task.spec or {}) and task.lease_id is not None
    if not secret_names_quietly(task.spec) and not session:
        return []
    key = (str(getattr(connection, "schema_name", "")), f"{task.pk}:{task.lease_id}")
    now = time.monotonic()
    kept = _masks.get(key)
    if kept is not None and now - kept[0] < MASK_SECONDS:
        return kept[1]
    values = secret_values_to_mask(task)
    if session:  # the run's gateway key, written by a careless program, is masked like a secret
        schema = str(getattr(connection, "schema_name", ""))
        values = sorted([*values, session_key(schema_name=schema, task=task)], key=len, reverse=True)
    _masks[key] = (now, values)
    _masks.move_to_end(key)
    while len(_masks) > 512:
        _masks.popitem(last=False)
    return values


def task_report(
    *,
    tenant: Tenant,
    task: Task,
    source: str,
    seq: int,
    kind: str,
    body: dict[str, Any],
    lease: TaskRun | None = None,
) -> bool:
    """Apply one report about the task's current run (`lease`, or the task's lease when the caller
    authenticated with the task token of that run), locked by the caller, once per (run, source, seq)."""
    if lease is None:
        lease = runs.current_run(task)
    if kind not in TaskReport.Kind.values:
        raise AgentRejected(f"Unknown report type {kind!r}: status, log, metric or result.")
    if kind == TaskReport.Kind.LOG and isinstance(body.get("lines"), list):
        values = _masked_values(task)
        if values:  # a task that printed its secret: stored, shown and followed as ***
            body = {**body, "lines": mask(body["lines"], values)}
    report = TaskReport(task=task, lease_id=task.lease_id, source=source, seq=seq, kind=kind, body=body)
    if not _keep_once(report):
        return False  # a replay after a reconnect or a retried post
    if kind == TaskReport.Kind.LOG:
        publish_log(
            tenant=tenant,
            task_id=str(task.pk),
            chunk={
                "type": "log",
                "cursor": report.pk,
                "seq": seq,
                "source": source,
                "stream": body.get("stream", "stdout"),
                "lines": body.get("lines", []),
            },
        )
    if kind == TaskReport.Kind.RESULT and body.get("requeue") is True and task.state == TaskState.DISPATCHING:
        _requeued(tenant, task, lease, str(body.get("reason") or "the cluster gave it back"))
        return True
    if (
        kind == TaskReport.Kind.STATUS
        and body.get("state") == "pending"
        and task.state == TaskState.DISPATCHING
    ):
        # Waiting inside the cluster's own queue: its reason is the task's reason.
        job = f" as job {body['job_id']}" if body.get("job_id") else ""
        task.reason_code = "cluster_pending"
        task.reason = (
            f"Waiting in {task.pool.environment if task.pool else 'the cluster'}{job}: "
            f"{str(body.get('reason') or 'pending')[:500]}"
        )
        deferred.update_fields(task, ["reason_code", "reason"])  # locked by the caller
    elif (
        kind in (TaskReport.Kind.STATUS, TaskReport.Kind.RESULT)
        and (kind == TaskReport.Kind.RESULT or body.get("state") == TaskState.RUNNING)
        and task.state == TaskState.DISPATCHING
    ):
        # Running now; or, for a result, it ran (a batch job can start and end between two looks).
        runs.run_started(lease, timezone.now())
        transition(
            task,
            to_state=TaskState.RUNNING,
            actor="agent",
            attempts=task.attempts + 1,
            started_at=timezone.now(),
            lease_expires_at=None,
            reason_code="",
            reason="",
        )
    if kind == TaskReport.Kind.RESULT and task.state in ACTIVE_STATES:
        exit_code = body.get("exit_code")
        outcome = RunOutcome.COMPLETED if exit_code == 0 else RunOutcome.FAILED
        runs.run_ended(lease, outcome=outcome, exit_code=exit_code, now=timezone.now())
        task = task_finish(
            tenant=tenant,
            task=task,
            succeeded=exit_code == 0,
            exit_code=exit_code,
            actor="agent",
            detail=_one_line(body.get("reason")),
            locked=True,  # by the caller, as every report's task is
        )
        _outputs_not_stored(task, body.get("outputs_failed"))
        if task.state in ENDED_STATES:  # a failed attempt that is retried is not the end of the task
            publish_log(tenant=tenant, task_id=str(task.pk), chunk={"type": "end", "state": task.state})
    return True


def _keep_once(report: TaskReport) -> bool:
    """Keep the report unless its run has it: the burst of messages it came in knows for the tasks it read
    (and took the new one's id), else the insert asks the database."""
    key = burst_report_new(report.task_id, report.lease_id, report.seq) if report.source == "agent" else None
    if key is None:
        return report.insert_once()
    if key:
        report.insert_new(key)
    return bool(key)


def _requeued(tenant: Tenant, task: Task, run: TaskRun | None, reason: str) -> None:
    """The agent took back a run that never started (a multi-node job only partly placed by the cluster):
    the task waits in the queue again, saying why; the attempt is not counted against it."""
    runs.run_ended(run, outcome=RunOutcome.REFUSED, exit_code=None, now=timezone.now())
    pool = task.pool.name if task.pool else "its pool"
    transition(
        task,
        to_state=TaskState.QUEUED,
        actor="agent",
        message=reason[:500],
        pool=None,
        lease_id=None,
        lease_expires_at=None,
        queued_at=timezone.now(),
        reason_code="requeued_by_agent",
        reason=f"The agent of pool {pool} gave it back to the queue: {reason[:500]}",
    )
    wake.request_cycle(tenant)


def _one_line(text: object) -> str:
    """An agent's reason as it goes into a task's reason: one line of printable text."""
    if not isinstance(text, str):
        return ""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:500]


def _outputs_not_stored(task: Task, failed: object) -> None:
    """A run that ended with outputs its agent could not store says so in the task's reason."""
    if not isinstance(failed, list) or not failed or task.state != TaskState.COMPLETED:
        return
    named = [item for item in failed if isinstance(item, dict) and isinstance(item.get("name"), str)]
    if not named:
        return
    names = ", ".join(str(item["name"])[:100] for item in named[:5]) + (" and more" if len(named) > 5 else "")
    why = str(named[0].get("error") or "no reason given")[:500]
    task.reason_code = "outputs_not_stored"
    task.reason = (
        f"It completed, but {len(named)} output(s) could not be stored ({names}): {why}. The files "
        "remain in the task's folder on its agent's host."
    )
    deferred.update_fields(task, ["reason_code", "reason"])  # locked by the caller
