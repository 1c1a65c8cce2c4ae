"""The plane's half of a cloud pool's autoscaling (protocol.cloud): instance tokens, handoffs to instances'
agents, and the instances' lifetimes.

The autoscaler is its pool's listener (an agent whose pool is a cloud or neocloud pool); it alone mints
tokens for the instances it starts, hands its runs on to their agents, and reports what the provider did
with them. An instance's token is good for that instance's agent only (its name is the agent id it is
bound to), for its first hello only until a short deadline, and never for these calls; it is revoked when
the instance ends. An instance that ends while work is on it (the cloud took it back, or it vanished) puts
that work back at the front of its queue as preempted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from apps.audit.services import record
from apps.core.events import publish_event
from apps.fleet import credentials
from apps.fleet.errors import AgentRejected, StaleLease
from apps.fleet.models import Agent, AgentToken, CloudInstance
from apps.fleet.selectors import pool_task, run_of
from apps.metering.services import instance_segment
from apps.resources.models import SCALES_FROM_ZERO
from apps.scheduling import lifecycle, runs, wake
from apps.scheduling.models import RunOutcome, TaskRun
from protocol import cloud

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)

REPORTED = ("provider_id", "instance_type", "gpus", "spot", "region", "reason")  # as the autoscaler says
METER_EVERY = timedelta(minutes=15)  # how often a long stretch in one state reaches the ledger
INSTANCE_TOKEN_SECONDS = 900.0  # an instance's agent must say hello within this, unless asked otherwise
MAX_INSTANCE_TOKEN_SECONDS = cloud.MAX_PATIENCE_SECONDS


@dataclass(frozen=True)
class Minted:
    token: str
    expires_at: float


def autoscaler_authenticate(*, presented: str) -> AgentToken:
    """The agent token of a cloud pool's autoscaler, or AgentRejected saying why this one is not."""
    token = credentials.agent_authenticate(presented=presented)
    if token.instance_of_id is not None:
        raise AgentRejected(
            "An instance's token serves its own agent only; the autoscaler's token starts instances."
        )
    if token.pool.environment not in SCALES_FROM_ZERO:
        raise AgentRejected(
            f"Pool {token.pool.name} is a {token.pool.environment} pool: only the autoscaler of a cloud or "
            "neocloud pool starts instances."
        )
    if not token.bound_agent_id:
        raise AgentRejected(
            "Connect the autoscaler first: its hello binds its token, then it may start instances."
        )
    return token


@transaction.atomic
def instance_token_mint(*, tenant: Tenant, token: AgentToken, name: str, seconds: float) -> Minted:
    """A token for the agent of a new instance `name`: pool-scoped, bound to that name, good for its first
    hello for `seconds`. The instance is recorded as launching. A name of another pool or autoscaler, or of
    an instance that ended, is refused."""
    if not cloud.INSTANCE_NAME.match(name):
        raise AgentRejected("An instance's name is lowercase letters, digits and dashes, 1 to 63 of them.")
    seconds = min(max(float(seconds), 60.0), MAX_INSTANCE_TOKEN_SECONDS)
    autoscaler = token.bound_agent_id
    instance = CloudInstance.objects.select_for_update().filter(pk=name).first()
    if instance is not None and (instance.pool_id != token.pool_id or instance.autoscaler != autoscaler):
        raise AgentRejected(f"Instance name {name} belongs to another pool or autoscaler; choose another.")
    if instance is not None and instance.ended_at is not None:
        raise AgentRejected(f"Instance {name} has ended; a new instance needs a new name.")
    if _taken(token, name):
        raise AgentRejected(f"Another agent is called {name}; choose another name.")
    now = timezone.now()
    if instance is not None and instance.token_id is not None:  # minted again: the first one dies
        AgentToken.objects.filter(pk=instance.token_id, revoked_at=None).update(revoked_at=now)
    issued = credentials.instance_token_create(
        autoscaler=token, agent_id=name, expires_at=now + timedelta(seconds=seconds)
    )
    if instance is None:
        instance = CloudInstance(name=name, pool_id=token.pool_id, autoscaler=autoscaler, launched_at=now)
    instance.token = issued.token
    instance.save()
    record(
        actor=f"agent {autoscaler}",
        action="cloud_instance.token",
        target=f"instance {name} of pool {token.pool.name}",
        expires_at=(now + timedelta(seconds=seconds)).isoformat(),
    )
    return Minted(issued.secret, (now + timedelta(seconds=seconds)).timestamp())


def _taken(token: AgentToken, name: str) -> bool:
    """Whether `name` is the id of an agent that is not one of this autoscaler's instances (an agent of
    another pool, the autoscaler itself, another kind of agent of this pool)."""
    return Agent.objects.filter(pk=name).exclude(token__instance_of=token).exists()


@transaction.atomic
def handoff(*, tenant: Tenant, token: AgentToken, handoff: cloud.Handoff) -> cloud.Handed:
    """Hand the autoscaler's run of a task on to an instance's agent: fenced by the run's lease (only the
    autoscaler that holds it, and only while it is the task's current run) and by the instance (one of this
    autoscaler's, not ended)."""
    pool = token.pool
    task = pool_task(handoff.task_id, pool)
    run = run_of(task, handoff.lease_id)
    if task is None or run is None or not runs.is_current(task, run) or run.agent_id != token.bound_agent_id:
        raise StaleLease(
            f"No live lease {handoff.lease_id} of task {handoff.task_id} is held by {token.bound_agent_id} "
            f"in pool {pool.name}; it may have been aborted, preempted or expired. Let it go."
        )
    instance = CloudInstance.objects.filter(
        pk=handoff.agent_id, pool=pool, autoscaler=token.bound_agent_id, ended_at=None
    ).first()
    if instance is None:
        raise AgentRejected(
            f"No running instance {handoff.agent_id} of pool {pool.name} is this autoscaler's."
        )
    where = f"cloud instance {instance.name}" + (
        f" ({instance.instance_type})" if instance.instance_type else ""
    )
    connected = Agent.objects.filter(pk=instance.name, connected=True).exists()
    reason = f"Handed to {where}." if connected else f"Starting on {where} of pool {pool.name}."
    following = lifecycle.run_hand_on(
        task, run, agent_id=instance.name, patience_seconds=handoff.patience_seconds,
        actor=f"agent {token.bound_agent_id}", reason=reason,
    )  # fmt: skip
    wake.notify_pool(tenant=tenant, pool_id=pool.pk, message={"type": "dispatch"})
    return cloud.Handed(str(following.pk), following.dispatched_at.timestamp())


@transaction.atomic
def instances_report(*, tenant: Tenant, token: AgentToken, report: cloud.InstancesReport) -> cloud.FleetView:
    """Record the autoscaler's instances. An instance that ended is forgotten by it from here on: its token is
    revoked, and what was on it goes back to the front of its queue. Returns the plane's view of the
    autoscaler's live instances' agents."""
    now = timezone.now()
    autoscaler = token.bound_agent_id
    known = CloudInstance.objects.select_for_update().in_bulk(
        [reported.name for reported in report.instances]
    )
    for reported in report.instances:
        instance = known.get(reported.name)
        if instance is None and _taken(token, reported.name):
            logger.warning("autoscaler %s reported %s, an agent not its instance", autoscaler, reported.name)
            continue
        if instance is None:  # adopted by the autoscaler, unknown here (its note was lost): recorded
            instance = CloudInstance(name=reported.name, pool_id=token.pool_id, autoscaler=autoscaler)
        elif instance.pool_id != token.pool_id or instance.autoscaler != autoscaler:
            logger.warning(
                "autoscaler %s reported instance %s, which is not its own", autoscaler, reported.name
            )
            continue
        if instance.ended_at is not None:
            continue  # a report repeated after the end: nothing more to do
        if not _update(instance, reported, now) and instance.pk in known:
            continue  # as it was: nothing to write
        if reported.state in cloud.ENDED:
            _ended(tenant, instance, reported, now)
        instance.save()
    return fleet_view(token=token, now=now)


def _update(instance: CloudInstance, reported: cloud.Instance, now: datetime) -> bool:
    """The instance as reported; its time metered up to now when its state changes (as the state it was
    in), and every METER_EVERY while it stays in a billed one. Whether anything of it changed."""
    before = [getattr(instance, name) for name in REPORTED]
    for name in REPORTED:
        setattr(instance, name, getattr(reported, name) or getattr(instance, name))
    changed = before != [getattr(instance, name) for name in REPORTED]
    if reported.state != instance.state:
        _meter(instance, now)
        instance.state, instance.state_since = reported.state, now
        if reported.state in cloud.BILLED and instance.metered_until is None:
            instance.metered_until = now
        return True
    if instance.metered_until is not None and now - instance.metered_until >= METER_EVERY:
        _meter(instance, now)
        return True
    return changed


def _meter(instance: CloudInstance, until: datetime) -> None:
    """The instance's time since it was last metered, into the ledger as its state's kind (busy or idle)."""
    since = instance.metered_until
    if instance.state not in cloud.BILLED or since is None or until <= since:
        return
    instance_segment(
        name=instance.name, instance_type=instance.instance_type, pool_id=str(instance.pool_id),
        busy=instance.state == cloud.BUSY, started_at=since, ended_at=until,
    )  # fmt: skip
    instance.metered_until = until


def _ended(tenant: Tenant, instance: CloudInstance, reported: cloud.Instance, now: datetime) -> None:
    instance.ended_at = now
    why = {
        cloud.INTERRUPTED: f"the cloud took back instance {instance.name}",
        cloud.STOPPED: f"instance {instance.name} was ended",
        cloud.FAILED: f"instance {instance.name} could not be started",
    }[reported.state]
    if reported.reason:
        why = f"{why} ({reported.reason[:300]})"
    # Its work first (a preempt reaches an agent still there, to checkpoint), then its token: it is closed.
    lifecycle.runs_interrupted(tenant, pool=instance.pool, agent_id=instance.name, why=why)
    if instance.token_id is not None:
        credentials.agent_token_revoke(tenant=tenant, token=AgentToken.objects.get(pk=instance.token_id))
    publish_event(
        tenant=tenant,
        kind=f"instance.{reported.state}",
        data={"instance": instance.name, "pool": instance.pool.name, "reason": reported.reason[:300]},
    )


def fleet_view(*, token: AgentToken, now: datetime) -> cloud.FleetView:
    """The autoscaler's live instances: whether each one's agent is connected, and the runs on it (handed to
    it and not ended), as of `now`, taken before anything is read: a run handed on later is not in it."""
    instances = CloudInstance.objects.filter(
        pool_id=token.pool_id, autoscaler=token.bound_agent_id, ended_at=None
    )
    names = list(instances.values_list("name", flat=True))
    deadline = timezone.now() - timedelta(seconds=token.pool.heartbeat_timeout_seconds)
    connected = set(
        Agent.objects.filter(pk__in=names, connected=True, last_heartbeat_at__gte=deadline).values_list(
            "pk", flat=True
        )
    )
    live = (
        TaskRun.objects.filter(
            agent_id__in=names,
            outcome=RunOutcome.LIVE,
            task__state__in=runs.LIVE_STATES,
            task__lease_id=F("pk"),
        )
        .order_by("dispatched_at")
        .values_list("agent_id", "task_id", "lease_id", "size_units")
    )
    on: dict[str, list[cloud.FleetRun]] = {name: [] for name in names}
    for agent_id, task_id, lease_id, units in live:
        on[agent_id].append(cloud.FleetRun(str(task_id), str(lease_id), units))
    agents = tuple(cloud.FleetAgent(name, name in connected, tuple(on[name])) for name in names)
    return cloud.FleetView(now.timestamp(), agents)
