"""The control plane's half of the agent protocol: tokens, hello and reconciliation, dispatch under a
lease, reports deduplicated by sequence number, and what happens when an agent goes away.

The protocol (JSON over the websocket at /agents/ws/, agent -> plane unless marked), its messages typed
and checked in protocol.messages by both sides:

    hello      {protocol, agent_id, instance, backend, version, inventory, capacity, held: [run]}
    welcome    plane -> agent {heartbeat_seconds, lease_seconds, keep: [run], stop: [abort|preempt]}
    assign     plane -> agent {task_id, lease_id, attempt, spec, gpus, nodes, sharing, ...}
    accepted   {task_id, lease_id}            rejected {task_id, lease_id, reason, permanent}
    status     {task_id, lease_id, seq, state}           log {task_id, lease_id, seq, stream, lines}
    metric     {task_id, lease_id, seq, values}          result {task_id, lease_id, seq, exit_code}
    ack        plane -> agent {task_id, lease_id, seq, verdict: applied|duplicate|stale, detail}
    abort      plane -> agent {task_id, lease_id}        preempt plane -> agent {..., grace_seconds}
    heartbeat  {held: [run], queue: [the cluster's view of its jobs, HPC agents], capacity}

A run is {task_id, lease_id, ended}: what the agent holds (running, or with reports not yet acknowledged).
Every report is answered with an ack whose verdict lets the agent drop it; a report whose lease is not
the task's run is stale, and changes nothing of the task.

capacity is {cpus, cpus_in_use, nodes}: the agent's host, or its cluster's nodes (for the dashboard).

An HPC job's node reporter posts its own reports (source "node-<rank>") over HTTPS with the task's token
(task_token), which is good for the task's current run only: see agent_reports_post in apis.py.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import hmac
import logging
import os
import secrets
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from django.conf import settings
from django.core.files.storage import default_storage
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from apps.accounts.tokens import hash_token
from apps.audit.services import record
from apps.core.errors import InvalidInput, NotFound
from apps.core.events import publish_event, publish_log
from apps.core.ids import as_uuid
from apps.fleet import notify
from apps.fleet.models import Agent, AgentToken, TaskOutput, TaskReport
from apps.resources.models import Pool
from apps.resources.services import pool_heartbeat
from apps.scheduling import lifecycle, runs, wake
from apps.scheduling.engine import UNITS_PER_GPU
from apps.scheduling.lifecycle import task_finish, transition
from apps.scheduling.models import ACTIVE_STATES, ENDED_STATES, RunOutcome, Task, TaskRun, TaskState
from apps.vault.services import mask, secret_names_quietly, secret_values_for, secret_values_to_mask
from protocol import messages

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10
LEASE_SECONDS = 30
MAX_COUNT = 100_000_000  # the most CPUs or nodes an agent may report
AGENT_TOKEN_KIND = "kqa"  # noqa: S105 -- the kind of token (kqa_<prefix>_<secret>), not a secret
TASK_TOKEN_KIND = "kqt"  # noqa: S105 -- kqt_<task id>_<signature>, not a secret


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class AgentRejected(Exception):
    """An agent's token or message cannot be accepted; the message says why."""


@dataclass(frozen=True)
class IssuedAgentToken:
    token: AgentToken
    secret: str


def agent_token_create(*, pool: Pool, name: str) -> IssuedAgentToken:
    """A token that lets one agent serve `pool`; shown once."""

    prefix = secrets.token_hex(4)
    secret = f"{AGENT_TOKEN_KIND}_{prefix}_{secrets.token_urlsafe(24)}"
    token = AgentToken.objects.create(pool=pool, name=name, prefix=prefix, secret_hash=hash_token(secret))
    return IssuedAgentToken(token, secret)


def agent_token_revoke(*, tenant: Tenant, token: AgentToken) -> AgentToken:
    """Revoke at once: new connections are refused, and a connected agent using it is disconnected."""
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        notify.notify_pool(
            tenant=tenant, pool_id=token.pool_id, message={"type": "revoked", "token_id": str(token.pk)}
        )
    return token


def agent_authenticate(*, presented: str) -> AgentToken:
    parts = presented.split("_", 2)  # the secret itself may contain underscores
    if len(parts) != 3 or parts[0] != AGENT_TOKEN_KIND:
        raise AgentRejected("Malformed agent token: expected kqa_<prefix>_<secret>, as issued for the pool.")
    token = AgentToken.objects.select_related("pool").filter(prefix=parts[1]).first()
    if token is None or not hmac.compare_digest(token.secret_hash, hash_token(presented)):
        raise AgentRejected(
            "Unknown agent token for this tenant; issue one with POST /api/v1/pools/{id}/agent-tokens/."
        )
    if token.revoked_at is not None:
        raise AgentRejected(
            f"Agent token kqa_{token.prefix} was revoked; issue a new one for pool {token.pool.name}."
        )
    AgentToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    return token


def agent_bind(*, tenant: Tenant, token: AgentToken, agent_id: str, instance: str, address: str = "") -> None:
    """Bind the token to the agent at its first hello; refuse another agent presenting it later.

    The binding is the agent's id and a hash of the random instance key it keeps in its work folder, so a
    token copied from a login node (a process list, a backup) is refused wherever it is used without that
    agent's key. The refusal is kept on the token, audited and published, for the pool's admins."""
    fingerprint = hashlib.sha256(instance.encode()).hexdigest() if instance else ""
    with transaction.atomic():
        current = AgentToken.objects.select_for_update().get(pk=token.pk)
        if not current.bound_agent_id:
            current.bound_agent_id, current.bound_instance = agent_id, fingerprint
            current.bound_at = timezone.now()
            current.save(update_fields=["bound_agent_id", "bound_instance", "bound_at"])
            return
        if (current.bound_agent_id, current.bound_instance) == (agent_id, fingerprint):
            return
        seen = f"agent {agent_id[:60]}" + (f" from {address}" if address else "")
        current.conflict_at = timezone.now()
        current.conflict = f"{seen} presented this token, bound to agent {current.bound_agent_id}"[:300]
        current.save(update_fields=["conflict_at", "conflict"])
        record(
            actor=f"agent {agent_id[:60]}",
            action="agent_token.conflict",
            target=f"agent token kqa_{current.prefix} of pool {current.pool.name}",
            address=address,
            bound_to=current.bound_agent_id,
        )
        publish_event(
            tenant=tenant,
            kind="agent_token.conflict",
            data={"token_id": str(current.pk), "pool": current.pool.name, "agent_id": agent_id[:60]},
        )
    logger.warning(
        "agent token kqa_%s of pool %s, bound to agent %s, was presented by %s: refused",
        current.prefix,
        current.pool.name,
        current.bound_agent_id,
        seen,
    )
    raise AgentRejected(
        f"Agent token kqa_{current.prefix} is bound to agent {current.bound_agent_id}, which first used it; "
        "another agent (or a copy of the token) is refused. Give each agent a token of its own "
        f"(POST /api/v1/pools/{current.pool_id}/agent-tokens/); an agent that was reinstalled needs a new "
        "token, and the old one revoked."
    )


@transaction.atomic
def agent_hello(*, tenant: Tenant, token: AgentToken, hello: messages.Hello) -> messages.Welcome:
    """Register the agent and reconcile the runs it holds with this agent's runs in the plane's view.

    Only this agent's runs are concerned (a pool may have several agents): a run the plane believes it
    has and it no longer holds is lost; a run it holds that the plane had given up on (its agent was
    silent past the pool's timeout) is adopted when the task has not been dispatched since; any other
    run it still holds is to be stopped. A finished run whose result is still in its outbox is left to
    that result."""
    pool = token.pool
    agent_id = hello.agent_id
    now = timezone.now()
    Agent.objects.update_or_create(
        id=agent_id,
        defaults={
            "pool": pool,
            "token": token,
            "backend": hello.backend,
            "version": hello.version,
            "inventory": hello.inventory,
            "connected": True,
            "connected_at": now,
            "last_heartbeat_at": now,
            **_capacity(hello.capacity),
        },
    )
    pool_heartbeat(tenant=tenant, pool=pool)
    held = {(run.task_id, run.lease_id): run for run in hello.held}
    keep: list[messages.Held] = []
    for task in Task.objects.select_for_update(of=("self",)).filter(pool=pool, state__in=runs.LIVE_STATES):
        run = runs.current_run(task)
        if run is not None and run.agent_id not in ("", agent_id):
            continue  # another agent's run
        key = (str(task.pk), str(task.lease_id))
        unnamed = (str(task.pk), "")  # held by an agent that predates leases: this is its run
        if key in held or (unnamed in held and run is not None):
            kept = held.pop(key, None) or held.pop(unnamed)
            keep.append(messages.Held(kept.task_id, str(task.lease_id), kept.ended))
            if run is not None and run.agent_id != agent_id:
                TaskRun.objects.filter(pk=run.pk).update(agent_id=agent_id)
        else:
            lifecycle.run_lost(tenant, task, f"agent {agent_id} came back without it")
    stop = []
    for holding in held.values():
        verdict = _held_elsewhere(tenant, pool, agent_id, holding)
        if verdict is True:
            keep.append(holding)
        elif isinstance(verdict, messages.Stop):
            stop.append(verdict)
    return messages.Welcome(heartbeat_seconds(pool), LEASE_SECONDS, tuple(keep), tuple(stop))


def _alive(tenant: Tenant, pool: Pool, agent_id: str) -> None:
    Agent.objects.filter(pk=agent_id).update(last_heartbeat_at=timezone.now(), connected=True)
    pool_heartbeat(tenant=tenant, pool=Pool.objects.get(pk=pool.pk))


def heartbeat_seconds(pool: Pool) -> float:
    """How often the pool's agents heartbeat: every HEARTBEAT_SECONDS, or thrice within a shorter
    heartbeat timeout, so that a live agent never looks silent between two heartbeats."""
    return max(1.0, min(float(HEARTBEAT_SECONDS), pool.heartbeat_timeout_seconds / 3))


def _held_elsewhere(
    tenant: Tenant, pool: Pool, agent_id: str, holding: messages.Held
) -> bool | messages.Stop | None:
    """A run the agent holds that is not one of its live runs: adopted (True), left to its result on the
    way (None), or to be stopped (the Stop to send)."""
    stop = messages.Stop("abort", holding.task_id, holding.lease_id)
    task = pool_task(holding.task_id, pool)
    lease = as_uuid(holding.lease_id)
    run = TaskRun.objects.select_for_update().filter(pk=lease, task=task).first() if task and lease else None
    if task is None or run is None:
        return None if holding.ended else stop
    if runs.reclaimable(task, run):
        lifecycle.run_adopt(tenant, task, run, agent_id=agent_id, ended=holding.ended)
        return True
    if holding.ended:
        return None  # its result will be recorded beside the task
    return messages.Stop(run.stop or "abort", holding.task_id, holding.lease_id, run.stop_grace_seconds)


def agent_gone(*, agent_id: str) -> None:
    Agent.objects.filter(pk=agent_id).update(connected=False)


def _capacity(reported: object) -> dict[str, int | None]:
    """The CPUs and nodes an agent reports, each a whole number from 0 to MAX_COUNT; what is missing or
    not such a number is unknown (None), never a guess."""
    given = reported if isinstance(reported, dict) else {}
    fields: dict[str, int | None] = {}
    for key in ("cpus", "cpus_in_use", "nodes"):
        value = given.get(key)
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
        fields[key] = value if ok else None
    return fields


@transaction.atomic
def agent_heartbeat(
    *, tenant: Tenant, token: AgentToken, agent_id: str, heartbeat: messages.Heartbeat
) -> list[messages.Stop]:
    """Record that the agent is alive and reconcile the runs it holds: a stopping run it no longer holds
    is released (its GPUs are free from now); a run it holds that it should not (aborted, preempted,
    another attempt's, unknown) is asked to stop again. Returns the stops to send."""
    now = timezone.now()
    fields: dict[str, Any] = {"last_heartbeat_at": now, "connected": True}
    if heartbeat.queue is not None:
        fields["queue"] = heartbeat.queue[:10_000]
    if heartbeat.capacity is not None:
        fields.update(_capacity(heartbeat.capacity))
    Agent.objects.filter(pk=agent_id).update(**fields)
    pool_heartbeat(tenant=tenant, pool=Pool.objects.get(pk=token.pool_id))
    held = {(run.task_id, run.lease_id): run for run in heartbeat.held}
    let_go = [
        run.pk
        for run in TaskRun.objects.filter(agent_id=agent_id, released_at=None).exclude(
            outcome=RunOutcome.LIVE
        )
        if (str(run.task_id), str(run.pk)) not in held
    ]
    if let_go:
        TaskRun.objects.filter(pk__in=let_go).update(released_at=now)
    leases = [lease for lease in (as_uuid(lease) for _, lease in held) if lease is not None]
    known = {
        (str(run.task_id), str(run.pk)): run
        for run in TaskRun.objects.filter(pk__in=leases, pool_id=token.pool_id).select_related("task")
    }
    stops = []
    for key, holding in held.items():
        run = known.get(key)
        if run is None:
            stops.append(messages.Stop("abort", holding.task_id, holding.lease_id))
        elif run.stop and not holding.ended:
            stops.append(messages.Stop(run.stop, holding.task_id, holding.lease_id, run.stop_grace_seconds))
        elif run.outcome != RunOutcome.LIVE and not holding.ended and not runs.reclaimable(run.task, run):
            stops.append(messages.Stop("abort", holding.task_id, holding.lease_id))
    return stops


def _signature(schema_name: str, task_id: object, lease_id: object) -> str:
    message = f"task-token:{schema_name}:{task_id}:{lease_id}".encode()
    digest = hmac.new(str(settings.SECRET_KEY).encode(), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def task_token(*, schema_name: str, task: Task) -> str:
    """A token that lets one run of one task report and upload outputs, from its compute nodes; it is
    good while that run is active (the lease it was dispatched under) and dies with it."""
    return f"{TASK_TOKEN_KIND}_{task.pk.hex}_{_signature(schema_name, task.pk, task.lease_id)}"


def task_authenticate(*, schema_name: str, presented: str, task_id: str) -> Task:
    """The task a task token is good for, locked, or AgentRejected saying why not."""
    parts = presented.split("_", 2)
    identifier = as_uuid(parts[1]) if len(parts) == 3 and parts[0] == TASK_TOKEN_KIND else None
    if identifier is None:
        raise AgentRejected("Malformed task token: expected kqt_<task>_<signature>, as the agent wrote it.")
    if str(identifier) != str(as_uuid(task_id)):
        raise AgentRejected("This task token is for another task.")
    task = Task.objects.select_for_update().filter(pk=identifier).first()
    if task is None or task.lease_id is None:
        raise AgentRejected("Unknown task token for this tenant.")
    if not hmac.compare_digest(parts[2], _signature(schema_name, task.pk, task.lease_id)):
        raise AgentRejected("This task token is not good for the task's current run.")
    if task.state not in (TaskState.DISPATCHING, TaskState.RUNNING):
        raise AgentRejected(f"Task {task.pk} is {task.state}; its token is no longer good.")
    return task


@transaction.atomic
def dispatch(*, pool: Pool, schema_name: str, agent_id: str = "") -> list[dict[str, Any]]:
    """Hand the pool's placed tasks to this agent, each as a new run under its own lease; returns the
    assign messages to send."""
    now = timezone.now()
    assigned = []
    placed = Task.objects.select_for_update(skip_locked=True, of=("self",)).select_related(
        "compute_resource__profile", "submitter", "project"
    )
    for task in placed.filter(pool=pool, state=TaskState.PLACED):
        try:
            secrets = secret_values_for(task)  # to the agent only, in this message; read recorded
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
            continue
        lease = uuid.uuid4()
        run = runs.run_begin(task, lease=lease, pool=pool, agent_id=agent_id, now=now)
        transition(
            task,
            to_state=TaskState.DISPATCHING,
            actor="scheduler",
            message=f"attempt {run.attempt}, lease {lease}" + (f", agent {agent_id}" if agent_id else ""),
            lease_id=lease,
            lease_expires_at=now + timedelta(seconds=LEASE_SECONDS),
        )
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
            "task_token": task_token(schema_name=schema_name, task=task),
            "secrets": secrets,
        }
        assigned.append(messages.Assign(str(task.pk), str(lease), run.attempt, details).as_json())
    return assigned


def pool_task(task_id: str, pool: Pool) -> Task | None:
    """The task with this id in this pool, locked; None for another pool's task or a malformed id. A task
    waiting in the queue again (its pool cleared) counts as the pool's if one of its runs was there."""
    identifier = as_uuid(task_id)
    if identifier is None:
        return None
    mine = Q(pool=pool) | Q(pool__isnull=True, runs__pool=pool)
    found = Task.objects.filter(mine, pk=identifier).values_list("pk", flat=True).first()
    return Task.objects.select_for_update(of=("self",)).filter(pk=found).first() if found else None


def _unnamed_run(task: Task | None, agent_id: str) -> TaskRun | None:
    """The run a report naming no lease is about: one an agent started before it spoke of leases (an
    upgrade while tasks ran), which is the task's live run on this agent, or nothing."""
    run = runs.current_run(task) if task is not None else None
    if task is None or run is None or not runs.is_current(task, run) or run.agent_id not in ("", agent_id):
        return None
    return run


def _run_of(task: Task | None, lease_id: str) -> TaskRun | None:
    lease = as_uuid(lease_id)
    if task is None or lease is None:
        return None
    return TaskRun.objects.select_for_update().filter(pk=lease, task=task).first()


@transaction.atomic
def lease_accepted(
    *, tenant: Tenant, pool: Pool, agent_id: str, accepted: messages.Accepted
) -> messages.Stop | None:
    """The agent took the run. A lease that is no longer the task's (expired and dispatched again, or the
    task aborted) is answered with a stop, so the run does not go on beside another; an expired lease of a
    task that waits in the queue still is the task's run again."""
    task = pool_task(accepted.task_id, pool)
    run = _run_of(task, accepted.lease_id)
    if task is not None and run is not None:
        if runs.is_current(task, run):
            Task.objects.filter(pk=task.pk).update(lease_expires_at=None)
            return None
        if runs.reclaimable(task, run):
            lifecycle.run_adopt(tenant, task, run, agent_id=agent_id, ended=False)
            _alive(tenant, pool, agent_id)
            return None
    raise StaleLease(
        f"No lease {accepted.lease_id} on task {accepted.task_id} in pool {pool.name} is live; it may have "
        "expired or the task ended. Do not run it.",
        messages.Stop("abort", accepted.task_id, accepted.lease_id),
    )


class StaleLease(AgentRejected):
    """A message about a lease that is not live; `stop` is what the agent should do with its run."""

    def __init__(self, message: str, stop: messages.Stop | None = None) -> None:
        super().__init__(message)
        self.stop = stop


@transaction.atomic
def lease_rejected(*, tenant: Tenant, pool: Pool, rejected: messages.Rejected) -> None:
    """A refused task waits in the queue again, unless the refusal is permanent (a user with no account
    on the cluster, a value no batch script may hold, a partition the cluster lacks): then it fails, with
    the agent's reason, rather than being placed and refused forever. A refusal of a lease that is not
    live changes nothing."""
    task = pool_task(rejected.task_id, pool)
    run = _run_of(task, rejected.lease_id)
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


@transaction.atomic
def report(*, tenant: Tenant, pool: Pool, agent_id: str, message: messages.Report) -> messages.Ack:
    """Apply one report of the pool's agent to the run its lease names, once, and say what became of it:
    applied, a duplicate (its number was seen), or stale (its run is not the task's: refused, expired,
    lost and run again, aborted). A result of a run that is not the task's is recorded beside it (a
    stop it confirms, a duplicate run), never taken as the task's."""
    task = pool_task(message.task_id, pool)
    run = _run_of(task, message.lease_id) if message.lease_id else _unnamed_run(task, agent_id)
    ack = partial(messages.Ack, message.task_id, message.lease_id, message.seq)
    if task is None or run is None:
        return ack(
            messages.STALE, f"Task {message.task_id} has no run {message.lease_id} in pool {pool.name}."
        )
    seen = TaskReport.objects.filter(task=task, lease_id=run.pk, source="agent", seq=message.seq)
    if seen.exists():
        return ack(messages.DUPLICATE)
    if not runs.is_current(task, run) and runs.reclaimable(task, run):  # e.g. its lease expired unanswered
        ended = message.kind == TaskReport.Kind.RESULT
        lifecycle.run_adopt(tenant, task, run, agent_id=agent_id, ended=ended)
        _alive(tenant, pool, agent_id)  # what it reports proves it is there: not lost again next cycle
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
    return ack(messages.APPLIED if kept else messages.DUPLICATE)


MASK_SECONDS = 60.0  # how long a process keeps a task's values to mask before reading them again
_masks: OrderedDict[tuple[str, str], tuple[float, list[str]]] = OrderedDict()


def _masked_values(task: Task) -> list[str]:
    """The values of the task's secrets, kept a minute in this process (log chunks come in bursts); a task
    that names no secret costs nothing."""
    if not secret_names_quietly(task.spec):
        return []
    key = (str(getattr(connection, "schema_name", "")), str(task.pk))
    now = time.monotonic()
    kept = _masks.get(key)
    if kept is not None and now - kept[0] < MASK_SECONDS:
        return kept[1]
    values = secret_values_to_mask(task)
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
    try:
        with transaction.atomic():
            report = TaskReport.objects.create(
                task=task, lease_id=task.lease_id, source=source, seq=seq, kind=kind, body=body
            )
    except IntegrityError:
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
    if (
        kind == TaskReport.Kind.STATUS
        and body.get("state") == "pending"
        and task.state == TaskState.DISPATCHING
    ):
        # Waiting inside the cluster's own queue: its reason is the task's reason.
        job = f" as job {body['job_id']}" if body.get("job_id") else ""
        Task.objects.filter(pk=task.pk).update(
            reason_code="cluster_pending",
            reason=f"Waiting in {task.pool.environment if task.pool else 'the cluster'}{job}: "
            f"{str(body.get('reason') or 'pending')[:500]}",
        )
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
            tenant=tenant, task=task, succeeded=exit_code == 0, exit_code=exit_code, actor="agent"
        )
        _outputs_not_stored(task, body.get("outputs_failed"))
        if task.state in ENDED_STATES:  # a failed attempt that is retried is not the end of the task
            publish_log(tenant=tenant, task_id=str(task.pk), chunk={"type": "end", "state": task.state})
    return True


def _outputs_not_stored(task: Task, failed: object) -> None:
    """A run that ended with outputs its agent could not store says so in the task's reason."""
    if not isinstance(failed, list) or not failed or task.state != TaskState.COMPLETED:
        return
    named = [item for item in failed if isinstance(item, dict) and isinstance(item.get("name"), str)]
    if not named:
        return
    names = ", ".join(str(item["name"])[:100] for item in named[:5]) + (" and more" if len(named) > 5 else "")
    why = str(named[0].get("error") or "no reason given")[:500]
    Task.objects.filter(pk=task.pk).update(
        reason_code="outputs_not_stored",
        reason=f"It completed, but {len(named)} output(s) could not be stored ({names}): {why}. The files "
        "remain in the task's folder on its agent's host.",
    )


MAX_OUTPUT_DEPTH = 16


class OutputNotStored(AgentRejected):
    """An upload the plane could not keep; `status` is the HTTP answer (507 full, 503 not writable: the
    agent retries; 409 a name clash, 413 too large: it does not)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _output_name(name: str) -> str:
    """A relative path of plain names inside the task's folder ("metrics.json", "eval/scores.csv")."""
    parts = PurePosixPath(name).parts
    plain = all(part not in ("", ".", "..") and len(part) <= 255 and "\\" not in part for part in parts)
    if (
        not parts
        or name.startswith("/")
        or not plain
        or len(parts) > MAX_OUTPUT_DEPTH
        or len(name) > 500
        or "\x00" in name
    ):
        raise AgentRejected(
            f"{name[:100]!r} cannot name an output: give a relative path of plain names inside the task's "
            f"folder (no '..', at most {MAX_OUTPUT_DEPTH} levels and 500 characters)."
        )
    return str(PurePosixPath(*parts))


def _store_error(name: str, error: OSError) -> OutputNotStored:
    """What went wrong keeping an output, in words: the plane's disk full, its store not writable, or a
    name that is a folder (or under a file) in what the task uploaded before."""
    causes = {
        errno.ENOSPC: ("the plane's file store is full", 507),
        errno.EDQUOT: ("the plane's file store is over its quota", 507),
        errno.EACCES: ("the plane's file store is not writable", 503),
        errno.EROFS: ("the plane's file store is read-only", 503),
        errno.EISDIR: ("a folder of that name holds other outputs", 409),
        errno.ENOTDIR: ("a part of its path is an output file already", 409),
        errno.EEXIST: ("a part of its path is an output file already", 409),
    }
    cause, status = causes.get(error.errno or 0, (f"the file store failed ({error.strerror})", 503))
    logger.warning("output %s not stored: %s", name, cause)
    return OutputNotStored(f"Output {name} could not be stored: {cause}.", status)


@transaction.atomic
def output_store(*, tenant: Tenant, task: Task, name: str, content: Readable, sha256: str = "") -> TaskOutput:
    """Keep a file the task's current run declared as output, replacing an earlier upload of the same
    name in that run (each run has its own set). The caller has checked that the uploader may write this
    run's outputs (its pool's agent under the run's lease, or the run's task token). With `sha256`, a file
    whose content does not match is not kept (422: the agent sends it again)."""
    name = _output_name(name)
    stored = f"{tenant.schema_name}/{task.pk}/{task.lease_id}/{name}"
    target = Path(default_storage.path(stored))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        size, digest = _write_atomically(target, name, content, sha256.lower())
    except OSError as error:
        raise _store_error(name, error) from None
    output, _ = TaskOutput.objects.update_or_create(
        task=task,
        lease_id=task.lease_id,
        name=name,
        defaults={"size": size, "sha256": digest, "stored": stored, "at": timezone.now()},
    )
    return output


def task_outputs(task: Task) -> Any:
    """The outputs of the task's latest run (those kept before runs had their own sets, too)."""
    return task.outputs.filter(Q(lease_id=task.lease_id) | Q(lease_id__isnull=True))


def _copy(content: Readable, handle: Any, name: str) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    while chunk := content.read(1024 * 1024):
        size += len(chunk)
        if size > settings.KLIQUE_MAX_OUTPUT_BYTES:
            raise OutputNotStored(
                f"Output {name} is larger than {settings.KLIQUE_MAX_OUTPUT_BYTES} bytes.", 413
            )
        digest.update(chunk)
        handle.write(chunk)
    handle.flush()
    os.fsync(handle.fileno())
    return size, digest.hexdigest()


def _check_digest(name: str, got: str, expected: str) -> None:
    if expected and got != expected:
        raise OutputNotStored(
            f"Output {name} arrived with SHA-256 {got}, not the {expected} the agent sent; send it again.",
            422,
        )


def _write_atomically(target: Path, name: str, content: Readable, expected: str = "") -> tuple[int, str]:
    """Stream the upload to a temporary file beside `target`, hashing it, then rename it into place: the
    file is never held in memory, and a reader never sees half of it (nor a crash, nor a full disk, leaves
    half of it, or an empty one)."""
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=".upload-")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            written = _copy(content, handle, name)
        _check_digest(name, written[1], expected)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return written


def task_metrics(task: Task, *, after: int = 0) -> list[dict[str, Any]]:
    """The metrics the task's nodes reported (the task's own values and GPU samples), in order."""
    return [
        {"cursor": cursor, "source": source, "at": at, "values": body.get("values", {})}
        for cursor, source, at, body in task.reports.filter(kind=TaskReport.Kind.METRIC, pk__gt=after)
        .order_by("pk")
        .values_list("pk", "source", "at", "body")
    ]


def task_logs(task: Task, *, after: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "cursor": cursor,
            "seq": seq,
            "source": source,
            "at": at,
            "stream": body.get("stream", "stdout"),
            "lines": body.get("lines", []),
        }
        for cursor, seq, source, at, body in task.reports.filter(kind=TaskReport.Kind.LOG, pk__gt=after)
        .order_by("pk")
        .values_list("pk", "seq", "source", "at", "body")
    ]
