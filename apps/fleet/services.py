"""The control plane's half of the agent protocol: tokens, hello and reconciliation, dispatch under a
lease, reports deduplicated by sequence number, and what happens when an agent goes away.

The protocol (JSON over the websocket at /agents/ws/, agent -> plane unless marked):

    hello      {agent_id, backend, version, inventory, capacity, running: [task ids]}
    welcome    plane -> agent {heartbeat_seconds, lease_seconds, keep: [task ids], abort: [task ids]}
    assign     plane -> agent {task_id, lease_id, spec, gpus, nodes, sharing}
    accepted   {task_id, lease_id}            rejected {task_id, lease_id, reason}
    status     {task_id, seq, state}          log {task_id, seq, stream, lines}
    metric     {task_id, seq, values}         result {task_id, seq, exit_code}
    abort      plane -> agent {task_id}       preempt plane -> agent {task_id, grace_seconds}
    heartbeat  {running: [task ids], queue: [the cluster's view of its jobs, HPC agents], capacity}

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
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from django.conf import settings
from django.core.files.storage import default_storage
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from apps.accounts.tokens import hash_token
from apps.audit.services import record
from apps.core.errors import InvalidInput, NotFound
from apps.core.events import publish_event, publish_log, send_to_group
from apps.core.ids import as_uuid
from apps.fleet.models import Agent, AgentToken, TaskOutput, TaskReport
from apps.resources.models import Pool
from apps.resources.services import pool_heartbeat
from apps.scheduling.engine import UNITS_PER_GPU
from apps.scheduling.models import ACTIVE_STATES, ENDED_STATES, Task, TaskState
from apps.scheduling.services import task_finish, transition
from apps.vault.services import mask, secret_names_quietly, secret_values_for, secret_values_to_mask

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10
LEASE_SECONDS = 30
PREEMPT_GRACE_SECONDS = 30
MAX_COUNT = 100_000_000  # the most CPUs or nodes an agent may report
AGENT_TOKEN_KIND = "kqa"  # noqa: S105 -- the kind of token (kqa_<prefix>_<secret>), not a secret
TASK_TOKEN_KIND = "kqt"  # noqa: S105 -- kqt_<task id>_<signature>, not a secret


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class AgentRejected(Exception):
    """An agent's token or message cannot be accepted; the message says why."""


def pool_group(schema_name: str, pool_id: object) -> str:
    return f"agents.{schema_name}.{pool_id}"


def notify_pool(*, tenant: Tenant, pool_id: object, message: dict[str, Any]) -> None:
    """Send `message` to the pool's connected agents once the current transaction commits."""

    group = pool_group(tenant.schema_name, pool_id)
    notice = {"type": "plane.message", "message": message}
    transaction.on_commit(lambda: send_to_group(group, notice, what=f"a {message.get('type')} notice"))


@dataclass(frozen=True)
class IssuedAgentToken:
    token: AgentToken
    secret: str


def agent_token_create(*, pool: Pool, name: str) -> IssuedAgentToken:
    """A token that lets one agent serve `pool`; shown once."""
    import secrets

    prefix = secrets.token_hex(4)
    secret = f"{AGENT_TOKEN_KIND}_{prefix}_{secrets.token_urlsafe(24)}"
    token = AgentToken.objects.create(pool=pool, name=name, prefix=prefix, secret_hash=hash_token(secret))
    return IssuedAgentToken(token, secret)


def agent_token_revoke(*, tenant: Tenant, token: AgentToken) -> AgentToken:
    """Revoke at once: new connections are refused, and a connected agent using it is disconnected."""
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
        notify_pool(
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


@dataclass(frozen=True)
class Welcome:
    keep: list[str]
    abort: list[str]


@transaction.atomic
def agent_hello(
    *,
    tenant: Tenant,
    token: AgentToken,
    agent_id: str,
    backend: str,
    version: str,
    inventory: dict[str, Any],
    running: list[str],
    capacity: object = None,
) -> Welcome:
    """Register the agent and reconcile what it runs with what the plane believes runs in its pool."""
    pool = token.pool
    Agent.objects.update_or_create(
        id=agent_id,
        defaults={
            "pool": pool,
            "token": token,
            "backend": backend,
            "version": version,
            "inventory": inventory,
            "connected": True,
            "connected_at": timezone.now(),
            "last_heartbeat_at": timezone.now(),
            **_capacity(capacity),
        },
    )
    pool_heartbeat(tenant=tenant, pool=pool)
    reported = set(running)
    keep, abort = [], []
    for task in Task.objects.select_for_update().filter(
        pool=pool, state__in=(TaskState.DISPATCHING, TaskState.RUNNING)
    ):
        if str(task.pk) in reported:
            keep.append(str(task.pk))
        else:
            _lost(tenant, task, f"agent {agent_id} no longer runs it")
    known = {
        str(pk)
        for pk in Task.objects.filter(
            pk__in=[as_uuid(t) for t in reported if as_uuid(t)], state__in=ACTIVE_STATES, pool=pool
        ).values_list("pk", flat=True)
    }
    abort = sorted(reported - known)
    return Welcome(keep, abort)


def _lost(tenant: Tenant, task: Task, why: str) -> None:
    """A task its agent no longer has: a run that never started goes back to the queue; a started run
    counts as a failed attempt, retried while attempts remain."""
    if task.state == TaskState.DISPATCHING:
        transition(
            task,
            to_state=TaskState.QUEUED,
            actor="scheduler",
            message=why,
            pool=None,
            lease_id=None,
            lease_expires_at=None,
            queued_at=timezone.now(),
            reason_code="lease_lost",
            reason=f"Its dispatch was lost ({why}); queued again.",
        )
    else:
        task_finish(tenant=tenant, task=task, succeeded=False, exit_code=None, actor="scheduler")


@transaction.atomic
def tasks_of_silent_pools(*, tenant: Tenant) -> int:
    """Tasks dispatched to or running in a pool whose agents stopped heartbeating beyond the pool's timeout
    are lost: a dispatch goes back to the queue, a run counts as a failed attempt. Returns how many."""
    now = timezone.now()
    silent = [pool.pk for pool in Pool.objects.all() if not pool.is_online(now)]
    lost = 0
    for task in Task.objects.select_for_update(skip_locked=True).filter(
        pool_id__in=silent, state__in=(TaskState.DISPATCHING, TaskState.RUNNING)
    ):
        _lost(tenant, task, f"pool {task.pool.name if task.pool else '?'} went silent")
        lost += 1
    return lost


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


def agent_heartbeat(
    *,
    tenant: Tenant,
    token: AgentToken,
    agent_id: str,
    queue: list[dict[str, Any]] | None = None,
    capacity: object = None,
) -> None:
    fields: dict[str, Any] = {"last_heartbeat_at": timezone.now(), "connected": True}
    if queue is not None:
        fields["queue"] = queue[:10_000]
    if capacity is not None:
        fields.update(_capacity(capacity))
    Agent.objects.filter(pk=agent_id).update(**fields)
    pool_heartbeat(tenant=tenant, pool=Pool.objects.get(pk=token.pool_id))


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
def dispatch(*, pool: Pool, schema_name: str) -> list[dict[str, Any]]:
    """Hand the pool's placed tasks to its agent under a lease; returns the assign messages to send."""
    now = timezone.now()
    messages = []
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
        transition(
            task,
            to_state=TaskState.DISPATCHING,
            actor="scheduler",
            message=f"lease {lease}",
            lease_id=lease,
            lease_expires_at=now + timedelta(seconds=LEASE_SECONDS),
        )
        messages.append(
            {
                "type": "assign",
                "task_id": str(task.pk),
                "lease_id": str(lease),
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
        )
    return messages


def pool_task(task_id: str, pool: Pool) -> Task | None:
    """The task with this id in this pool, locked; None for another pool's task or a malformed id."""
    identifier = as_uuid(task_id)
    if identifier is None:
        return None
    return Task.objects.select_for_update().filter(pk=identifier, pool=pool).first()


def _leased(task_id: str, lease_id: str, pool: Pool) -> Task:
    task = pool_task(task_id, pool)
    if task is None or str(task.lease_id) != lease_id:
        raise AgentRejected(
            f"No lease {lease_id} on task {task_id} in pool {pool.name}; it may have expired."
        )
    return task


@transaction.atomic
def lease_accepted(*, pool: Pool, task_id: str, lease_id: str) -> None:
    task = _leased(task_id, lease_id, pool)
    Task.objects.filter(pk=task.pk).update(lease_expires_at=None)


@transaction.atomic
def lease_rejected(
    *, tenant: Tenant, pool: Pool, task_id: str, lease_id: str, reason: str, permanent: bool = False
) -> None:
    """A refused task waits in the queue again, unless the refusal is permanent (a user with no account
    on the cluster, a value no batch script may hold, a partition the cluster lacks): then it fails, with
    the agent's reason, rather than being placed and refused forever."""
    from apps.scheduling.tasks import request_cycle

    task = _leased(task_id, lease_id, pool)
    if permanent:
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
        request_cycle(tenant)
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
def report(*, tenant: Tenant, pool: Pool, task_id: str, seq: int, kind: str, body: dict[str, Any]) -> bool:
    """Apply one report of the pool's agent once: a sequence number already seen changes nothing.
    Returns whether it was new."""
    task = pool_task(task_id, pool)
    if task is None:
        raise AgentRejected(f"Task {task_id} is not in pool {pool.name}.")
    return task_report(tenant=tenant, task=task, source="agent", seq=seq, kind=kind, body=body)


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
    *, tenant: Tenant, task: Task, source: str, seq: int, kind: str, body: dict[str, Any]
) -> bool:
    """Apply one report about a task, locked by the caller, once per (source, seq)."""
    if kind not in TaskReport.Kind.values:
        raise AgentRejected(f"Unknown report type {kind!r}: status, log, metric or result.")
    if kind == TaskReport.Kind.LOG and isinstance(body.get("lines"), list):
        values = _masked_values(task)
        if values:  # a task that printed its secret: stored, shown and followed as ***
            body = {**body, "lines": mask(body["lines"], values)}
    try:
        with transaction.atomic():
            report = TaskReport.objects.create(task=task, source=source, seq=seq, kind=kind, body=body)
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
        task = task_finish(
            tenant=tenant, task=task, succeeded=exit_code == 0, exit_code=exit_code, actor="agent"
        )
        if task.state in ENDED_STATES:  # a failed attempt that is retried is not the end of the task
            publish_log(tenant=tenant, task_id=str(task.pk), chunk={"type": "end", "state": task.state})
    return True


MAX_OUTPUT_DEPTH = 16


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


def _store_error(name: str, error: OSError) -> AgentRejected:
    """What went wrong keeping an output, in words: the plane's disk full, its store not writable, or a
    name that is a folder (or under a file) in what the task uploaded before."""
    causes = {
        errno.ENOSPC: "the plane's file store is full",
        errno.EDQUOT: "the plane's file store is over its quota",
        errno.EACCES: "the plane's file store is not writable",
        errno.EROFS: "the plane's file store is read-only",
        errno.EISDIR: "a folder of that name holds other outputs",
        errno.ENOTDIR: "a part of its path is an output file already",
        errno.EEXIST: "a part of its path is an output file already",
    }
    cause = causes.get(error.errno or 0, f"the file store failed ({error.strerror})")
    return AgentRejected(f"Output {name} could not be stored: {cause}.")


@transaction.atomic
def output_store(*, tenant: Tenant, task: Task, name: str, content: Readable) -> TaskOutput:
    """Keep a file a task declared as output, replacing an earlier upload of the same name. The caller
    has checked that the uploader may write this task's outputs (its pool's agent, or its task token)."""
    name = _output_name(name)
    stored = f"{tenant.schema_name}/{task.pk}/{name}"
    target = Path(default_storage.path(stored))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        size, digest = _write_atomically(target, name, content)
    except OSError as error:
        raise _store_error(name, error) from None
    output, _ = TaskOutput.objects.update_or_create(
        task=task,
        name=name,
        defaults={"size": size, "sha256": digest, "stored": stored, "at": timezone.now()},
    )
    return output


def _copy(content: Readable, handle: Any, name: str) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    while chunk := content.read(1024 * 1024):
        size += len(chunk)
        if size > settings.KLIQUE_MAX_OUTPUT_BYTES:
            raise AgentRejected(f"Output {name} is larger than {settings.KLIQUE_MAX_OUTPUT_BYTES} bytes.")
        digest.update(chunk)
        handle.write(chunk)
    handle.flush()
    os.fsync(handle.fileno())
    return size, digest.hexdigest()


def _write_atomically(target: Path, name: str, content: Readable) -> tuple[int, str]:
    """Stream the upload to a temporary file beside `target`, hashing it, then rename it into place: the
    file is never held in memory, and a reader never sees half of it (nor a crash leaves half of it)."""
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=".upload-")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            written = _copy(content, handle, name)
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
