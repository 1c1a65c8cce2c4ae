"""Reads of tasks and queues, in the schema the caller is in."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connection
from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from apps.accounts.models import ProjectMembership, Role, User
from apps.resources.models import ComputeResource, ResourcePolicy
from apps.scheduling import objectives
from apps.scheduling.engine import describe, describe_seconds
from apps.scheduling.models import ACTIVE_STATES, Task, TaskState, WaitObjective


def compute_resources() -> QuerySet[ComputeResource]:
    """Every compute resource of the tenant: anyone in it may see the queues and how they are doing."""
    return ComputeResource.objects.select_related("policy__group", "profile")


def compute_resources_for(user: User) -> QuerySet[ComputeResource]:
    """The compute resources a user may submit to: those whose policy's group the user is in."""
    return compute_resources().filter(policy__group__members=user)


def policies_for(user: User) -> list[dict[str, Any]]:
    """Each policy of the person's groups: its reservation and limit, what its tasks hold now (and how
    much of that is theirs), and the compute resources it opens to them. The portal's Queues page and
    the MCP server's policies resource show it."""
    rows = []
    policies = ResourcePolicy.objects.filter(group__members=user).select_related("group").distinct()
    for policy in policies.prefetch_related("compute_resources").order_by("name"):
        in_use = Task.objects.filter(compute_resource__policy=policy, state__in=ACTIVE_STATES)
        yours = in_use.filter(submitter=user)
        rows.append(
            {
                "policy": policy.name,
                "group": policy.group.name,
                "reservation": describe(policy.reservation_units),
                "limit": describe(policy.limit_units),
                "in_use": describe(in_use.aggregate(units=Sum("size_units"))["units"] or 0),
                "yours": describe(yours.aggregate(units=Sum("size_units"))["units"] or 0),
                "resources": sorted(resource.name for resource in policy.compute_resources.all()),
                "objectives": objectives_standing(
                    WaitObjective.objects.filter(
                        Q(policy=policy) | Q(compute_resource__policy=policy)
                    ).select_related("policy", "compute_resource")
                ),
            }
        )
    return rows


TREND_HOURS = 7 * 24  # the dashboard's chart: the last week, hour by hour (or the window, if shorter)


def _window_text(seconds: int) -> str:
    return f"{seconds // 86_400} d" if seconds % 86_400 == 0 else describe_seconds(seconds)


def objectives_standing(
    rows: QuerySet[WaitObjective] | None = None, *, trend: bool = False
) -> list[dict[str, Any]]:
    """How each queue-wait objective stands now, as people read it: what it promises ("p95 within 1 h
    over 7 d"), for whom, the value measured, attainment, the error budget left, the last hour's burn and
    its state; with `trend`, its hourly samples over its window too (the dashboard's chart)."""
    if rows is None:
        rows = WaitObjective.objects.select_related("policy", "compute_resource")
    standing = []
    for objective in rows:
        current = objectives.status(objective, explain=False)
        sizes = ""
        if objective.min_units is not None or objective.max_units is not None:
            low = describe(objective.min_units) if objective.min_units is not None else "any"
            high = describe(objective.max_units) if objective.max_units is not None else "any"
            sizes = f", tasks of {low} to {high}"
        percentile = f"{objective.percentile:g}"
        figures = current.as_dict()
        value = figures["value_seconds"]
        budget = figures["error_budget_left"]
        row: dict[str, Any] = {
            "id": str(objective.pk),
            "name": objective.name,
            "scope": f"policy {objective.policy.name}"
            if objective.policy
            else f"compute resource {objective.compute_resource.name}"
            if objective.compute_resource
            else "-",
            "promise": f"p{percentile} within {describe_seconds(objective.target_seconds)} "
            f"over {_window_text(objective.window_seconds)}{sizes}",
            "value": "-" if value is None else describe_seconds(value),
            "target": describe_seconds(objective.target_seconds),
            "attainment": "-" if figures["attainment"] is None else f"{100 * figures['attainment']:.1f}%",
            "goal": f"{percentile}%",
            "error_budget_left": "-" if budget is None else f"{100 * budget:.0f}%",
            "burn_rate": "-"
            if figures["burn_rate_last_hour"] is None
            else f"{figures['burn_rate_last_hour']:.1f}",
            "state": current.state,
            "figures": figures,
        }
        if current.state != WaitObjective.State.OK:  # what keeps its tasks waiting, for whoever reads it
            _, reasons = objectives.why_waiting(objective, timezone.now())
            row["why"] = [
                {**reason, "waited": describe_seconds(reason["wait_seconds"])} for reason in reasons
            ]
        if trend:
            row["trend"] = objectives.trend(
                objective, hours=min(TREND_HOURS, objective.window_seconds // 3600)
            )
        standing.append(row)
    return standing


def tasks_in_play() -> bool:
    """Whether the tenant has tasks queued or under way: its cycles are due (leases, time limits, lost
    agents and waiting work are all watched by the cycle)."""
    return Task.objects.filter(state__in=(TaskState.QUEUED, *ACTIVE_STATES)).exists()


def tasks_visible_to(user: User) -> QuerySet[Task]:
    """Everyone in a tenant may read its tasks (viewers included): their state, size, queue and reason.
    What a task wrote (output, metrics, files) is narrower: see may_read_output. Writes are checked per
    action."""
    return Task.objects.select_related("compute_resource", "submitter", "pool", "project")


def may_read_output(user: User, task: Task) -> bool:
    """A task's output, metrics and files are its submitter's, its project's members' and the tenant
    admins': what a task prints may be data, or a secret it was given, that other people of the tenant
    must not read."""
    if not user.is_active:
        return False
    if user.has_role(Role.ADMIN) or task.submitter_id == user.pk:
        return True
    return (
        task.project_id is not None
        and ProjectMembership.objects.filter(project_id=task.project_id, user=user).exists()
    )


def output_readers(task: Task) -> str:
    """Who may read the task's output, as a sentence."""
    project = f", members of project {task.project.name}" if task.project is not None else ""
    return f"Only {task.submitter.username}{project} and tenant admins read what this task wrote."


def active_tasks_per_pool() -> dict[str, int]:
    rows = Task.objects.filter(state__in=ACTIVE_STATES, pool__isnull=False).values("pool__name")
    return {row["pool__name"]: row["count"] for row in rows.annotate(count=Count("id"))}


@dataclass(frozen=True)
class Why:
    state: str
    reason_code: str
    reason: str
    position: int | None  # 1 = next in its compute resource's queue
    queued_ahead: int
    waiting_seconds: float | None


def why(task: Task) -> Why:
    """Why a task waits, and where it stands in its compute resource's queue."""
    now = timezone.now()
    if task.state != TaskState.QUEUED:
        return Why(task.state, task.reason_code, task.reason or f"It is {task.state}.", None, 0, None)
    # The engine's in-queue order (engine.task_order): priority, then submit time, then id.
    ahead = Task.objects.filter(
        Q(priority__gt=task.priority)
        | Q(priority=task.priority, submitted_at__lt=task.submitted_at)
        | Q(priority=task.priority, submitted_at=task.submitted_at, id__lt=task.id),
        compute_resource=task.compute_resource,
        state=TaskState.QUEUED,
    ).count()
    reason = task.reason or "Waiting for the next scheduling cycle."
    return Why(task.state, task.reason_code, reason, ahead + 1, ahead, (now - task.queued_at).total_seconds())


@dataclass(frozen=True)
class WaitStats:
    placed: int
    p50_seconds: float | None
    p95_seconds: float | None


def queue_wait(*, by: str, window: timedelta = timedelta(hours=24)) -> dict[str, WaitStats]:
    """p50 and p95 queue wait of tasks placed within `window`, by compute resource id or group name."""
    column = {
        "compute_resource": "task.compute_resource_id::text",
        "group": "grp.name",
    }[by]
    sql = f"""
        SELECT {column},
               count(*),
               percentile_cont(0.5) WITHIN GROUP (ORDER BY task.wait_seconds),
               percentile_cont(0.95) WITHIN GROUP (ORDER BY task.wait_seconds)
          FROM scheduling_task task
          JOIN resources_computeresource resource ON resource.id = task.compute_resource_id
          JOIN resources_resourcepolicy policy ON policy.id = resource.policy_id
          JOIN accounts_group grp ON grp.id = policy.group_id
         WHERE task.placed_at >= %s AND task.wait_seconds IS NOT NULL
         GROUP BY 1
    """  # noqa: S608 -- the column comes from the fixed mapping above, never from input
    with connection.cursor() as cursor:
        cursor.execute(sql, [timezone.now() - window])
        return {key: WaitStats(count, p50, p95) for key, count, p50, p95 in cursor.fetchall()}


def queue_depths() -> dict[str, dict[str, int]]:
    """Queued and active task counts per compute resource id."""
    rows = (
        Task.objects.filter(compute_resource__isnull=False)
        .values("compute_resource_id")
        .annotate(
            queued=Count("id", filter=Q(state=TaskState.QUEUED)),
            active=Count("id", filter=Q(state__in=ACTIVE_STATES)),
        )
    )
    return {
        str(row["compute_resource_id"]): {"queued": row["queued"], "active": row["active"]} for row in rows
    }
