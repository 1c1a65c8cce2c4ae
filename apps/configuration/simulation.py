"""`klique simulate`: replay work against the draft configuration and the provisioned one, side by side,
so an administrator sees what a change would do before provisioning it.

The work is the tenant's own recent history (tasks that ran: their submit time, size and how long they
ran) or a CSV trace (`timestamp,duration,num_gpus,compute_resource`). Compute resources are matched by
name, so a job whose compute resource the draft removes counts as refused there. Every pool counts as
online: the question is what the configuration would do, not whether today's agents are up.

Each side reports the whole, each policy (team) and each compute resource, and how each of the tenant's
queue-wait objectives would have fared: the share of its jobs that started within its target, over the
whole replay (a replay is one window), against its percentile.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from apps.core.errors import InvalidInput
from apps.resources.models import MIG_METHODS, ComputeResource, Pool, ResourcePolicy, ResourceProfile
from apps.scheduling import engine
from apps.scheduling.engine.simulate import Job, Outcome, Setup, percentile, replay
from apps.scheduling.models import Task, WaitObjective

MAX_TRACE_ROWS = 200_000


def _sharing(methods: list[str]) -> frozenset[engine.Sharing]:
    sharing = {engine.Sharing.WHOLE}
    if "fraction" in methods:
        sharing.add(engine.Sharing.FRACTION)
    if set(methods) & MIG_METHODS:
        sharing.add(engine.Sharing.MIG)
    return frozenset(sharing)


def setup_from_document(document: dict[str, Any], name: str) -> Setup:
    """A Setup from a validated configuration document; ids are names, queues are compute resource names."""
    pools = tuple(
        engine.Pool(
            pool["name"], pool["capacity_gpus"] * engine.UNITS_PER_GPU, True, _sharing(pool["sharing"])
        )
        for pool in document["pools"]
    )
    profiles = tuple(
        engine.Profile(
            profile["name"],
            tuple(entry["pool"] for entry in profile["pools"]),
            {entry["pool"]: entry["execution_priority"] for entry in profile["pools"]},
            profile["strict_fifo"],
            float(profile["starvation_seconds"]) if profile["starvation_seconds"] else None,
        )
        for profile in document["profiles"]
    )
    policies, queues = [], []
    display = {
        profile["name"]: profile["display_name"] or profile["name"] for profile in document["profiles"]
    }
    for policy in document["policies"]:
        policies.append(engine.Policy(policy["name"], policy["reservation_units"], policy["limit_units"]))
        for resource in policy["compute_resources"]:
            label = resource["name"] or f"{policy['group'].title()}: {display[resource['profile']]}"
            queues.append(
                engine.Queue(label, policy["name"], resource["profile"], resource["queuing_priority"])
            )
    return Setup(name, pools, profiles, tuple(policies), tuple(queues))


def setup_from_active(name: str) -> Setup:
    pools = tuple(
        engine.Pool(pool.name, pool.capacity_gpus * engine.UNITS_PER_GPU, True, _sharing(pool.sharing))
        for pool in Pool.objects.all()
    )
    profiles = []
    for profile in ResourceProfile.objects.prefetch_related("pool_order__pool"):
        order = list(profile.pool_order.all())
        profiles.append(
            engine.Profile(
                profile.name,
                tuple(entry.pool.name for entry in order),
                {entry.pool.name: entry.execution_priority for entry in order},
                profile.strict_fifo,
                float(profile.starvation_seconds) if profile.starvation_seconds else None,
            )
        )
    policies = tuple(
        engine.Policy(policy.name, policy.reservation_units, policy.limit_units)
        for policy in ResourcePolicy.objects.all()
    )
    queues = tuple(
        engine.Queue(resource.name, resource.policy.name, resource.profile.name, resource.queuing_priority)
        for resource in ComputeResource.objects.select_related("policy", "profile")
    )
    return Setup(name, pools, tuple(profiles), policies, queues)


def jobs_from_history(days: int) -> list[Job]:
    """The tenant's tasks that ran in the last `days` days, as jobs."""
    now = timezone.now()
    rows = Task.objects.filter(
        submitted_at__gte=now - timedelta(days=days), started_at__isnull=False
    ).values_list(
        "pk",
        "compute_resource_name",
        "submitted_at",
        "started_at",
        "ended_at",
        "size_units",
        "time_limit_seconds",
    )
    return [
        Job(
            str(pk),
            resource,
            submitted.timestamp(),
            ((ended or now) - (started or now)).total_seconds(),  # started is set: filtered above
            size,
            resource,
            float(limit) if limit else None,
        )
        for pk, resource, submitted, started, ended, size, limit in rows
    ]


def jobs_from_csv(text: str) -> list[Job]:
    """Jobs from `timestamp,duration,num_gpus,compute_resource` rows (timestamps as YYYY-MM-DD HH:MM:SS)."""
    reader = csv.DictReader(io.StringIO(text))
    needed = {"timestamp", "duration", "num_gpus", "compute_resource"}
    if not reader.fieldnames or not needed <= set(reader.fieldnames):
        raise InvalidInput(f"A trace needs the columns {', '.join(sorted(needed))}.", field="trace")
    jobs: list[Job] = []
    for line, row in enumerate(reader, start=2):
        if len(jobs) >= MAX_TRACE_ROWS:
            raise InvalidInput(f"A trace has at most {MAX_TRACE_ROWS} rows.", field="trace")
        try:
            submit = datetime.strptime(row["timestamp"], "%Y-%m-%d %H:%M:%S").timestamp()
            duration = float(row["duration"])
            size = engine.units(row["num_gpus"])
        except (ValueError, engine.SizeError) as error:
            raise InvalidInput(f"Trace line {line}: {error}", field="trace") from None
        if duration < 0 or size <= 0:
            raise InvalidInput(f"Trace line {line}: duration and num_gpus must be positive.", field="trace")
        jobs.append(
            Job(f"line{line}", row["compute_resource"], submit, duration, size, row["compute_resource"])
        )
    return jobs


@dataclass(frozen=True)
class Objective:
    """A queue-wait objective as a replay judges it: which jobs it covers, and its promise."""

    name: str
    policy: str | None
    compute_resource: str | None
    percentile: float
    target_seconds: float
    min_units: int | None = None
    max_units: int | None = None

    def covers(self, job: Job) -> bool:
        in_scope = job.group == self.policy if self.policy is not None else job.queue == self.compute_resource
        return (
            in_scope
            and (self.min_units is None or job.size >= self.min_units)
            and (self.max_units is None or job.size <= self.max_units)
        )


def objectives_of_tenant() -> list[Objective]:
    return [
        Objective(
            row.name,
            row.policy.name if row.policy else None,
            row.compute_resource.name if row.compute_resource else None,
            row.percentile,
            row.target_seconds,
            row.min_units,
            row.max_units,
        )
        for row in WaitObjective.objects.select_related("policy", "compute_resource")
    ]


@dataclass(frozen=True)
class Comparison:
    jobs: int
    current: Outcome
    proposed: Outcome
    reservations: dict[str, int]  # policy -> units, as provisioned: every team is judged by the same
    replayed: tuple[Job, ...] = ()
    objectives: tuple[Objective, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "current": self.side(self.current),
            "proposed": self.side(self.proposed),
        }

    def side(self, outcome: Outcome) -> dict[str, Any]:
        return {
            **outcome_dict(outcome, self.reservations),
            "resources": resources_list(outcome, self.replayed),
            "objectives": [objective_dict(outcome, each, self.replayed) for each in self.objectives],
        }


def compare(*, draft: dict[str, Any], jobs: list[Job], interval: float = 60.0) -> Comparison:
    """Replay `jobs` through the provisioned configuration and through `draft`, on the same entitlements
    (each compute resource's policy reservation as provisioned), so the two columns compare like with like."""
    if not jobs:
        raise InvalidInput("There is nothing to replay: no task ran in that period, and no trace was given.")
    current = setup_from_active("current")
    proposed = setup_from_document(draft, "proposed")
    entitlements = {policy.id: policy.reservation for policy in current.policies}
    policy_of = {queue.id: queue.policy for queue in current.queues}
    jobs = [replace(job, group=policy_of.get(job.queue, job.queue)) for job in jobs]
    return Comparison(
        len(jobs),
        replay(current, jobs, interval=interval, entitlements=entitlements),
        replay(proposed, jobs, interval=interval, entitlements=entitlements),
        entitlements,
        tuple(jobs),
        tuple(objectives_of_tenant()),
    )


def _waits(outcome: Outcome, jobs: list[Job]) -> list[float]:
    return [outcome.job_waits[job.id] for job in jobs if job.id in outcome.job_waits]


def resources_list(outcome: Outcome, jobs: tuple[Job, ...]) -> list[dict[str, Any]]:
    """Each compute resource's jobs in a replay: how many were submitted and started, and their waits."""
    by_queue: dict[str, list[Job]] = {}
    for job in jobs:
        by_queue.setdefault(job.queue, []).append(job)
    rows = []
    for queue in sorted(by_queue):
        waits = _waits(outcome, by_queue[queue])
        rows.append(
            {
                "compute_resource": queue,
                "jobs": len(by_queue[queue]),
                "jobs_started": len(waits),
                "wait_p50_seconds": percentile(waits, 0.5),
                "wait_p95_seconds": percentile(waits, 0.95),
                "wait_p99_seconds": percentile(waits, 0.99),
            }
        )
    return rows


def objective_dict(outcome: Outcome, objective: Objective, jobs: tuple[Job, ...]) -> dict[str, Any]:
    """How an objective would have fared in a replay: its jobs that started, the share within target
    (attainment), the value at its percentile, and whether that meets it."""
    waits = _waits(outcome, [job for job in jobs if objective.covers(job)])
    within = sum(1 for wait in waits if wait <= objective.target_seconds)
    attainment = within / len(waits) if waits else None
    return {
        "objective": objective.name,
        "policy": objective.policy,
        "compute_resource": objective.compute_resource,
        "percentile": objective.percentile,
        "target_seconds": objective.target_seconds,
        "jobs_started": len(waits),
        "value_seconds": percentile(waits, objective.percentile / 100),
        "attainment": None if attainment is None else round(attainment, 4),
        "met": None if attainment is None else attainment >= objective.percentile / 100,
    }


def team_dict(outcome: Outcome, team: str, reservation: int) -> dict[str, Any]:
    """One policy's (team's) figures in a replay: its waits, what it ran, borrowed and lost to preemption."""
    span = outcome.span_seconds or 1.0
    used = outcome.group_gpu_unit_seconds.get(team, 0.0)
    return {
        "policy": team,
        "jobs_started": len(outcome.group_waits.get(team, [])),
        "wait_p50_seconds": outcome.group_wait_percentile(team, 0.5),
        "wait_p95_seconds": outcome.group_wait_percentile(team, 0.95),
        "wait_p99_seconds": outcome.group_wait_percentile(team, 0.99),
        "gpu_hours": round(used / engine.UNITS_PER_GPU / 3600, 2),
        "reservation_gpus": reservation / engine.UNITS_PER_GPU,
        # The share of its reservation the team used over the replay (above 1: it borrowed on top).
        "reservation_use": round(used / (reservation * span), 4) if reservation else None,
        "borrowed_gpu_hours": round(
            outcome.group_borrowed_unit_seconds.get(team, 0.0) / engine.UNITS_PER_GPU / 3600, 2
        ),
        "preemptions_suffered": outcome.group_preemptions.get(team, 0),
    }


def outcome_dict(outcome: Outcome, reservations: dict[str, int] | None = None) -> dict[str, Any]:
    teams = sorted(set(reservations or {}) | set(outcome.group_waits))
    return {
        "teams": [team_dict(outcome, team, (reservations or {}).get(team, 0)) for team in teams],
        "jobs": outcome.jobs,
        "refused": outcome.refused,
        "finished": outcome.finished,
        "gpu_utilization": round(outcome.utilization, 4),
        "wait_p50_seconds": outcome.wait_percentile(0.5),
        "wait_p95_seconds": outcome.wait_percentile(0.95),
        "mean_completion_seconds": outcome.mean_completion_time,
        "reservation_violation_seconds": outcome.reservation_violation_seconds,
        "preemptions": outcome.preemptions,
    }
