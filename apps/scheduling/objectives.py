"""Queue wait as a published objective (an SLO) per policy or compute resource: its attainment over its
window, the error budget left, how fast the last hour burns it, and why the tasks over target wait.

A task counts once it is placed (its wait is known) or once it has waited longer than the target while
still queued (it will miss whatever happens next): starving work is never invisible. With N such tasks
and M of them over the target, attainment is 1 - M/N, the objective allows (1 - percentile/100) x N
misses, and the budget left is what of that allowance is unspent. The objective is breached when the
budget is spent, and at risk when the last hour spends it at least twice as fast as the window allows
(a burn rate of 2: at that pace the budget is gone halfway through the window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.utils import timezone

from apps.core.errors import InvalidInput
from apps.core.events import publish_event
from apps.resources.models import ComputeResource, ResourcePolicy
from apps.scheduling import webhooks
from apps.scheduling.models import TaskState, WaitObjective, WaitObjectiveSample
from tenants import due

if TYPE_CHECKING:
    from tenants.models import Tenant

MIN_WINDOW_SECONDS = 3600
MAX_WINDOW_SECONDS = 90 * 86_400
AT_RISK_BURN = 2.0
BURN_WINDOW = timedelta(hours=1)
TOP_WAITING = 10
TREND_KEPT = timedelta(seconds=MAX_WINDOW_SECONDS) + timedelta(days=1)


@dataclass(frozen=True)
class Attainment:
    counted: int  # tasks placed in the window, and tasks still queued past the target
    missed: int  # of them, those over the target
    value_seconds: float | None  # the objective's percentile of their waits

    def fraction(self) -> float | None:
        return None if not self.counted else 1 - self.missed / self.counted


@dataclass(frozen=True)
class Status:
    objective: WaitObjective
    window: Attainment
    last_hour: Attainment
    state: str
    waiting: list[dict[str, Any]] = field(default_factory=list)  # tasks over target now, longest first
    reasons: list[dict[str, Any]] = field(default_factory=list)  # why they wait, by reason

    @property
    def allowed_misses(self) -> float:
        return (1 - self.objective.percentile / 100) * self.window.counted

    @property
    def budget_left(self) -> float | None:
        """The share of the error budget unspent (0 to 1; 0 once breached); None with nothing counted."""
        if not self.window.counted:
            return None
        allowed = self.allowed_misses
        return (
            max(0.0, 1 - self.window.missed / allowed)
            if allowed
            else (1.0 if not self.window.missed else 0.0)
        )

    @property
    def burn_rate(self) -> float | None:
        """How fast the last hour spends the budget: 1 spends it exactly by the window's end."""
        hour = self.last_hour
        allowed = 1 - self.objective.percentile / 100
        if not hour.counted or not allowed:
            return None
        return (hour.missed / hour.counted) / allowed

    def as_dict(self) -> dict[str, Any]:
        objective = self.objective
        return {
            "state": self.state,
            "value_seconds": self.window.value_seconds,
            "target_seconds": objective.target_seconds,
            "attainment": self.window.fraction(),
            "goal": objective.percentile / 100,
            "tasks_counted": self.window.counted,
            "tasks_over_target": self.window.missed,
            "error_budget_left": self.budget_left,
            "burn_rate_last_hour": self.burn_rate,
            "waiting_over_target": self.waiting,
            "why_waiting": self.reasons,
        }


def _scope_sql(objective: WaitObjective) -> tuple[str, list[Any]]:
    """The SQL condition (on `task`) for the objective's tasks, and its parameters."""
    clauses: list[str] = []
    params: list[Any] = []
    if objective.compute_resource_id is not None:
        clauses.append("task.compute_resource_id = %s")
        params.append(objective.compute_resource_id)
    else:
        clauses.append(
            "task.compute_resource_id IN (SELECT id FROM resources_computeresource WHERE policy_id = %s)"
        )
        params.append(objective.policy_id)
    if objective.min_units is not None:
        clauses.append("task.size_units >= %s")
        params.append(objective.min_units)
    if objective.max_units is not None:
        clauses.append("task.size_units <= %s")
        params.append(objective.max_units)
    return " AND ".join(clauses), params


def attainment(objective: WaitObjective, *, since: datetime, now: datetime) -> Attainment:
    """The objective's tasks placed since `since`, and those queued now for longer than the target."""
    scope, params = _scope_sql(objective)
    sql = f"""
        WITH waits AS (
            SELECT task.wait_seconds AS wait
              FROM scheduling_task task
             WHERE {scope} AND task.placed_at >= %s AND task.wait_seconds IS NOT NULL
            UNION ALL
            SELECT EXTRACT(EPOCH FROM (%s - task.queued_at)) AS wait
              FROM scheduling_task task
             WHERE {scope} AND task.state = %s AND task.queued_at < %s
        )
        SELECT count(*), count(*) FILTER (WHERE wait > %s),
               percentile_cont(%s) WITHIN GROUP (ORDER BY wait)
          FROM waits
    """  # noqa: S608 -- the scope's SQL is fixed text; every value is a parameter
    target = objective.target_seconds
    values = [
        *params, since,
        now, *params, TaskState.QUEUED, now - timedelta(seconds=target),
        target, objective.percentile / 100,
    ]  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        counted, missed, value = cursor.fetchone()
    return Attainment(int(counted), int(missed), None if value is None else float(value))


def status(objective: WaitObjective, *, now: datetime | None = None, explain: bool = True) -> Status:
    """How the objective stands; with `explain`, also the tasks over target and why they wait (a query
    of its own, left out where only the figures are read: /metrics, and objectives that did not change)."""
    now = now or timezone.now()
    window = attainment(objective, since=now - timedelta(seconds=objective.window_seconds), now=now)
    hour = attainment(objective, since=now - BURN_WINDOW, now=now)
    partial = Status(objective, window, hour, WaitObjective.State.OK)
    state = WaitObjective.State.OK
    if window.counted and window.missed > partial.allowed_misses:
        state = WaitObjective.State.BREACHED
    elif (partial.burn_rate or 0.0) >= AT_RISK_BURN and hour.missed:
        state = WaitObjective.State.AT_RISK
    if not explain:
        return replace(partial, state=state)
    waiting, reasons = why_waiting(objective, now)
    return Status(objective, window, hour, state, waiting, reasons)


def why_waiting(objective: WaitObjective, now: datetime) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The tasks queued now for longer than the target (longest first), and their waiting summed by the
    reason the scheduler gives (over limit, reserved for another, no pool of the size, budget exhausted,
    pool offline, starvation hold...)."""
    scope, params = _scope_sql(objective)
    late = now - timedelta(seconds=objective.target_seconds)
    sql = f"""
        SELECT task.id::text, task.reason_code, task.reason, EXTRACT(EPOCH FROM (%s - task.queued_at))
          FROM scheduling_task task
         WHERE {scope} AND task.state = %s AND task.queued_at < %s
         ORDER BY task.queued_at
    """  # noqa: S608 -- the scope's SQL is fixed text; every value is a parameter
    with connection.cursor() as cursor:
        cursor.execute(sql, [now, *params, TaskState.QUEUED, late])
        rows = cursor.fetchall()
    by_reason: dict[str, dict[str, Any]] = {}
    for _, code, reason, waited in rows:
        entry = by_reason.setdefault(
            code or "unknown",
            {"reason_code": code or "unknown", "tasks": 0, "wait_seconds": 0.0, "example": reason},
        )
        entry["tasks"] += 1
        entry["wait_seconds"] += float(waited)
    waiting = [
        {"task": task_id, "reason_code": code, "reason": reason, "wait_seconds": float(waited)}
        for task_id, code, reason, waited in rows[:TOP_WAITING]
    ]
    return waiting, sorted(by_reason.values(), key=lambda entry: -entry["wait_seconds"])


# -- administration ------------------------------------------------------------------------------------


def objective_save(
    *,
    name: str,
    percentile: float,
    target_seconds: int,
    window_seconds: int,
    policy: str | None = None,
    compute_resource: str | None = None,
    min_units: int | None = None,
    max_units: int | None = None,
    objective: WaitObjective | None = None,
) -> WaitObjective:
    """Set an objective, saying what is wrong with it where something is."""
    if not (isinstance(percentile, int | float) and math.isfinite(percentile) and 0 < percentile < 100):
        raise InvalidInput(
            f"percentile is between 0 and 100, both excluded (95 for p95); {percentile!r} was given.",
            field="percentile",
        )
    if target_seconds <= 0:
        raise InvalidInput(
            "target_seconds is the longest wait the objective allows, more than 0.", field="target_seconds"
        )
    if not MIN_WINDOW_SECONDS <= window_seconds <= MAX_WINDOW_SECONDS:
        raise InvalidInput(
            f"window_seconds is from {MIN_WINDOW_SECONDS} (an hour) to {MAX_WINDOW_SECONDS} (90 days); "
            f"{window_seconds} was given.",
            field="window_seconds",
        )
    if (policy is None) == (compute_resource is None):
        raise InvalidInput(
            "An objective is for one policy or one compute resource: name exactly one.", field="policy"
        )
    if min_units is not None and max_units is not None and min_units > max_units:
        raise InvalidInput("min_gpus is above max_gpus.", field="min_gpus")
    row = objective or WaitObjective()
    row.name, row.percentile, row.target_seconds, row.window_seconds = (
        name,
        float(percentile),
        target_seconds,
        window_seconds,
    )
    row.min_units, row.max_units = min_units, max_units
    row.policy = row.compute_resource = None
    if policy is not None:
        row.policy = ResourcePolicy.objects.filter(name=policy).first()
        if row.policy is None:
            raise InvalidInput(f"No policy {policy!r}; `klique config show` lists them.", field="policy")
    else:
        row.compute_resource = ComputeResource.objects.filter(name=compute_resource).first()
        if row.compute_resource is None:
            raise InvalidInput(f"No compute resource {compute_resource!r}.", field="compute_resource")
    if WaitObjective.objects.filter(name=name).exclude(pk=row.pk).exists():
        raise InvalidInput(f"An objective named {name!r} exists already.", field="name")
    row.save()
    due.mark_on_commit(connection.schema_name, "objectives")  # type: ignore[attr-defined]
    return row


def measure_due(now: datetime | None = None) -> bool:
    """Whether the tenant's objectives are to be measured (periodic work due) beside every minute its tasks
    are in play: one not ok (its window slides it back), or one without a sample this last hour."""
    hour = (now or timezone.now()).replace(minute=0, second=0, microsecond=0)
    rows = WaitObjective.objects.all()
    return rows.exclude(state=WaitObjective.State.OK).exists() or rows.exclude(samples__hour=hour).exists()


# -- announcing ----------------------------------------------------------------------------------------


@transaction.atomic
def objectives_evaluate(*, tenant: Tenant, now: datetime | None = None) -> list[Status]:
    """Measure every objective; announce each change of state once (slo.at_risk, slo.breached,
    slo.recovered on the tenant's events and webhooks), with the tasks over target and why they wait."""
    now = now or timezone.now()
    changed, samples = [], []
    for objective in WaitObjective.objects.select_for_update(skip_locked=True):
        current = status(objective, now=now, explain=False)
        samples.append(_sample(current, now))
        if current.state == objective.state:
            continue
        waiting, reasons = why_waiting(objective, now)
        current = replace(current, waiting=waiting, reasons=reasons)
        kind = "slo.recovered" if current.state == WaitObjective.State.OK else f"slo.{current.state}"
        data = {"objective": objective.name, **current.as_dict()}
        publish_event(tenant=tenant, kind=kind, data=data)
        webhooks.announce(kind, data)  # and to the tenant's webhooks, sent after this commits
        WaitObjective.objects.filter(pk=objective.pk).update(state=current.state, state_since=now)
        changed.append(current)
    # The hour's last measurement stands for it: every objective's sample in one statement.
    WaitObjectiveSample.objects.bulk_create(
        samples,
        update_conflicts=True,
        unique_fields=["objective", "hour"],
        update_fields=["value_seconds", "target_seconds", "attainment", "error_budget_left", "state"],
    )
    WaitObjectiveSample.objects.filter(hour__lt=now - TREND_KEPT).delete()
    return changed


# -- the trend -----------------------------------------------------------------------------------------


def _sample(current: Status, now: datetime) -> WaitObjectiveSample:
    """The measurement as its hour's sample."""
    return WaitObjectiveSample(
        objective=current.objective,
        hour=now.replace(minute=0, second=0, microsecond=0),
        value_seconds=current.window.value_seconds,
        target_seconds=current.objective.target_seconds,
        attainment=current.window.fraction(),
        error_budget_left=current.budget_left,
        state=current.state,
    )


def trend(
    objective: WaitObjective, *, now: datetime | None = None, hours: int | None = None
) -> dict[str, Any]:
    """The objective's hourly samples over its window (or the last `hours`), oldest first, as a chart's
    series: the measured percentile and the target (in minutes), attainment and the budget left (in %).
    An hour without a sample (no measurement ran) is a gap (None), not a guess."""
    now = now or timezone.now()
    count = hours or max(1, objective.window_seconds // 3600)
    last = now.replace(minute=0, second=0, microsecond=0)
    first = last - timedelta(hours=count - 1)
    samples = {
        sample.hour: sample
        for sample in WaitObjectiveSample.objects.filter(objective=objective, hour__gte=first, hour__lte=last)
    }
    hours_ = [first + timedelta(hours=offset) for offset in range(count)]

    def series(read: Any) -> list[float | None]:
        return [None if (sample := samples.get(hour)) is None else read(sample) for hour in hours_]

    return {
        "hours": [hour.isoformat() for hour in hours_],
        "labels": [f"{hour:%b %d %H:00}" for hour in hours_],
        "value_minutes": series(
            lambda s: None if s.value_seconds is None else round(s.value_seconds / 60, 1)
        ),
        "target_minutes": series(lambda s: round(s.target_seconds / 60, 1)),
        "attainment_percent": series(
            lambda s: None if s.attainment is None else round(100 * s.attainment, 2)
        ),
        "error_budget_left_percent": series(
            lambda s: None if s.error_budget_left is None else round(100 * s.error_budget_left, 1)
        ),
        "states": series(lambda s: s.state),
    }
