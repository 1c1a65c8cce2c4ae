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

This module is the agent's session: hello and reconciliation, heartbeats, going away. Dispatch and
reports are dispatch.py's, outputs outputs.py's, tokens credentials.py's.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.utils import timezone

from apps.core.events import publish_event
from apps.core.ids import as_uuid
from apps.fleet.models import Agent, AgentToken
from apps.fleet.selectors import pool_task
from apps.resources.models import SCALES_FROM_ZERO, Pool
from apps.scheduling import lifecycle, runs, wake
from apps.scheduling.models import RunOutcome, Task, TaskRun, TaskState
from protocol import messages

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)


HEARTBEAT_SECONDS = 10


LEASE_SECONDS = 30


MAX_COUNT = 100_000_000  # the most CPUs or nodes an agent may report
MAX_GPU_CLASSES = 64  # GPU classes and MIG profiles one agent may report


def pool_heartbeat(*, tenant: Tenant, pool: Pool) -> Pool:
    """Record that the pool's agent is alive (each hello and heartbeat of its agents). A pool that comes
    back online is an event for the scheduler: its capacity is usable again. A pool whose heartbeats stop is
    noticed by beat's periodic cycle, which reads online-ness from the heartbeat's age.

    The pool's row is written at most once per sixth of its timeout (15 s of 90): a pool of many agents
    would otherwise write one row at each of their heartbeats. What is recorded is then at most that much
    plus a heartbeat's interval old, well within the timeout, so a live pool never looks offline."""
    now = timezone.now()
    was_online = pool.is_online(now)
    fresh = timedelta(seconds=pool.heartbeat_timeout_seconds / 6)
    if was_online and pool.last_heartbeat_at is not None and now - pool.last_heartbeat_at < fresh:
        return pool
    pool.last_heartbeat_at = now
    pool.save(update_fields=["last_heartbeat_at"])
    if not was_online:
        publish_event(tenant=tenant, kind="pool.online", data={"pool": pool.name})
        wake.request_cycle(tenant)
    return pool


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
            "problem": _with_region(token, hello.inventory, hello.problem),
            **_capacity(hello.capacity),
        },
    )
    instance = token.instance_of_id is not None
    if not instance:  # a cloud pool is online through its autoscaler, with or without instances
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
        elif instance and task.state == TaskState.DISPATCHING and task.lease_expires_at is not None:
            continue  # handed on to this instance and not yet accepted: dispatch sends it (again)
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


def _region_bound(token: AgentToken) -> bool:
    """Whether the token is a cloud pool's autoscaler's, and its pool names a region it must start in."""
    pool = token.pool
    return token.instance_of_id is None and pool.environment in SCALES_FROM_ZERO and bool(pool.region)


def _with_region(token: AgentToken, inventory: object, problem: str) -> str:
    """An autoscaler that starts instances in another region than its pool's says so as its problem (its
    pool then takes no work: a project limited to the pool's region must not land elsewhere)."""
    pool = token.pool
    region = inventory.get("region") if isinstance(inventory, dict) else None
    if not _region_bound(token) or not isinstance(region, str) or region == pool.region:
        return problem
    mismatch = (
        f"it starts instances in region {region[:50]}, but pool {pool.name} is in {pool.region}: set "
        "[agent.cloud] region or the pool's region so that they agree"
    )
    return f"{mismatch}; {problem}"[:500] if problem else mismatch


def agent_alive(tenant: Tenant, pool: Pool, agent_id: str) -> None:
    Agent.objects.filter(pk=agent_id).update(last_heartbeat_at=timezone.now(), connected=True)
    if not Agent.objects.filter(pk=agent_id, token__instance_of__isnull=False).exists():
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


def agent_gone(*, tenant: Tenant, agent_id: str) -> None:
    """The agent's connection closed. The stopped runs it had not let go of no longer hold GPUs in the
    cycle's view (it counts only connected agents'), so a cycle is asked for when there were any."""
    Agent.objects.filter(pk=agent_id).update(connected=False)
    if TaskRun.objects.filter(agent_id=agent_id, released_at=None).exclude(stop="").exists():
        runs.run_stop_released(tenant)


def _count(value: object) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
    return value if ok else None  # type: ignore[return-value]


def _capacity(reported: object) -> dict[str, Any]:
    """The CPUs and nodes an agent reports, each a whole number from 0 to MAX_COUNT; what is missing or
    not such a number is unknown (None), never a guess. And its GPUs per class and resource: entries
    that are not well formed are left out."""
    given = reported if isinstance(reported, dict) else {}
    fields: dict[str, Any] = {key: _count(given.get(key)) for key in ("cpus", "cpus_in_use", "nodes")}
    gpus: list[dict[str, Any]] = []
    listed = given.get("gpus")
    for entry in listed if isinstance(listed, list) else []:
        if not isinstance(entry, dict) or len(gpus) >= MAX_GPU_CLASSES:
            continue
        named = [entry.get("class"), entry.get("resource")]
        counts = [_count(entry.get("allocatable")), _count(entry.get("allocated"))]
        if all(isinstance(name, str) and 0 < len(name) <= 100 for name in named) and None not in counts:
            gpus.append(
                {"class": named[0], "resource": named[1], "allocatable": counts[0], "allocated": counts[1]}
            )
    fields["gpus"] = gpus
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
    if heartbeat.problem is not None:
        inventory = (  # what its region is checked against: an autoscaler's only
            Agent.objects.filter(pk=agent_id).values_list("inventory", flat=True).first()
            if _region_bound(token)
            else None
        )
        fields["problem"] = _with_region(token, inventory, heartbeat.problem)
    Agent.objects.filter(pk=agent_id).update(**fields)
    if token.instance_of_id is None:  # a cloud instance's agent does not make its pool online
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
        runs.run_stop_released(tenant)
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
