"""What the tenant's dashboard shows, read from the database: GPUs in use and free per pool, environment
and GPU class, what the agents report, utilization from the ledger's rollups, idle GPUs from the samples
the nodes report, GPUs in use per group. The views (views.py) only render it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import connection
from django.db.models import Sum

from apps.fleet.selectors import NONE_REPORTED, agents_by_pool, cloud_instances
from apps.metering.ledger import gpu_hours
from apps.metering.models import Rollup
from apps.metering.selectors import instance_hours_text, instance_time, usd_text
from apps.resources.models import Pool
from apps.scheduling.engine import UNITS_PER_GPU
from apps.scheduling.models import ACTIVE_STATES, Task
from apps.scheduling.selectors import objectives_standing

IDLE_BELOW = 80.0  # percent: a running task's GPUs averaging less than this over the last hour are idle


# The utilization chart's ranges: how many buckets of the ledger's rollups, of which grain.
RANGES = {"24h": (24, "hour"), "7d": (7, "day"), "30d": (30, "day")}


def _utilization_chart(pools: list[dict[str, Any]], now: Any, span: str) -> dict[str, Any]:
    """GPU utilization per hour (last 24 hours) or per day (last 7 or 30 days): metered GPU time over
    the pools' capacity. The ledger's rollups count an event in the hour (and day) it ended."""

    count, grain = RANGES.get(span, RANGES["24h"])
    hourly = grain == "hour"
    step = timedelta(hours=1) if hourly else timedelta(days=1)
    last = now.replace(minute=0, second=0, microsecond=0)
    if not hourly:
        last = last.replace(hour=0)
    buckets = [last - step * (count - 1 - offset) for offset in range(count)]
    used: dict[Any, float] = dict.fromkeys(buckets, 0.0)
    rows = Rollup.objects.filter(grain=grain, kind="gpu", bucket__gte=buckets[0]).values_list(
        "bucket", "gpu_unit_ms"
    )
    for bucket, unit_ms in rows:
        if bucket in used:
            used[bucket] += float(gpu_hours(unit_ms))
    capacity_hours = (sum(pool["capacity"] for pool in pools) or 1) * (1 if hourly else 24)
    return {
        "span": span if span in RANGES else "24h",
        "labels": [f"{bucket:%H:00}" if hourly else f"{bucket:%b %d}" for bucket in buckets],
        "percent": [round(100 * used[bucket] / capacity_hours, 1) for bucket in buckets],
    }


# Each running task's GPU samples of the last hour, averaged from the counts and sums each metric report
# got when it was kept (TaskReport.gpu_samples): a busy tenant keeps hundreds of thousands of metric
# reports an hour, and the dashboard reloads every 15 seconds.
IDLE_SQL = """
SELECT report.task_id, sum(report.gpu_percent_sum) / sum(report.gpu_samples)
FROM fleet_taskreport report
JOIN scheduling_task task ON task.id = report.task_id AND task.state = 'running'
WHERE report.gpu_samples > 0 AND report.at >= %s
GROUP BY report.task_id
HAVING sum(report.gpu_percent_sum) / sum(report.gpu_samples) < %s
"""


def idle_tasks(now: Any) -> list[dict[str, Any]]:
    """Running tasks whose GPUs averaged under IDLE_BELOW percent over the last hour (from the GPU samples
    their nodes report)."""

    with connection.cursor() as cursor:
        cursor.execute(IDLE_SQL, [now - timedelta(hours=1), IDLE_BELOW])
        averages = dict(cursor.fetchall())
    tasks = Task.objects.filter(pk__in=list(averages)).select_related("pool", "submitter")
    idle = [
        {
            "task": task,
            "pool": task.pool.name if task.pool else "-",
            "user": task.submitter.username,
            "average": round(averages[task.pk], 1),
        }
        for task in tasks
    ]
    return sorted(idle, key=lambda row: row["average"])


def dashboard_figures(now: Any, span: str = "24h") -> dict[str, Any]:
    """What the dashboard shows, as of now: GPUs in use and free per pool, environment and GPU class;
    CPUs, workers and nodes per environment, as its agents last said; GPUs in use per group;
    utilization over the span asked for; idle GPUs."""

    agents = agents_by_pool()
    held = dict(
        Task.objects.filter(state__in=ACTIVE_STATES, pool__isnull=False)
        .values("pool_id")
        .annotate(units=Sum("size_units"))
        .values_list("pool_id", "units")
    )
    pools: list[dict[str, Any]] = []
    for pool in Pool.objects.order_by("environment", "name"):
        reported = agents.get(pool.pk, NONE_REPORTED)
        pools.append(
            {
                "name": pool.name,
                "environment": pool.environment,
                "gpu_class": pool.gpu_class or "-",
                "capacity": pool.capacity_gpus,
                "used": round((held.get(pool.pk) or 0) / UNITS_PER_GPU, 3),
                "workers": reported.workers,
                "online": pool.is_online(now),
                "cpus": reported.cpus,
                "cpus_in_use": reported.cpus_in_use,
                "nodes": reported.nodes,
                "gpu_classes": reported.gpus,  # a cluster agent's count per GPU class and MIG profile
                "problems": reported.problems,  # what stops its agents, in their words
            }
        )
    chart = {
        "labels": [pool["name"] for pool in pools],
        "used": [pool["used"] for pool in pools],
        "free": [max(pool["capacity"] - pool["used"], 0) for pool in pools],
    }
    by_group = dict(
        Task.objects.filter(state__in=ACTIVE_STATES, compute_resource__isnull=False)
        .values("compute_resource__policy__group__name")
        .annotate(units=Sum("size_units"))
        .values_list("compute_resource__policy__group__name", "units")
    )
    return {
        "pools": pools,
        "environments": _totals(pools, "environment"),
        "classes": _totals(pools, "gpu_class"),
        "chart": chart,
        "utilization": _utilization_chart(pools, now, span),
        "idle": idle_tasks(now),
        "idle_below": IDLE_BELOW,
        "groups": sorted((group, round(units / UNITS_PER_GPU, 3)) for group, units in by_group.items()),
        "instances": cloud_instance_rows(now),
    }


def objective_figures() -> list[dict[str, Any]]:
    """Every queue-wait objective as it stands, with its last week's trend for a chart each."""
    return [
        {**row, "chart_id": f"objective-trend-{index}"}
        for index, row in enumerate(objectives_standing(trend=True))
    ]


def cloud_instance_rows(now: Any) -> list[dict[str, Any]]:
    """The cloud pools' live instances: their state, since when, and this month's busy and idle hours and
    cost (what an instance costs while it runs no work is the idle cost to cut)."""
    instances = list(cloud_instances(live=True))
    if not instances:
        return []
    time = instance_time(since=now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
    rows = []
    for instance in instances:
        figures = time.get(instance.name, {})
        rows.append(
            {
                "name": instance.name,
                "pool": instance.pool.name,
                "instance_type": instance.instance_type or "-",
                "spot": instance.spot,
                "state": instance.state,
                "since": instance.state_since,
                "idle_hours": instance_hours_text(figures.get("idle_ms", 0)),
                "idle_cost": usd_text(figures.get("idle_nano_usd", 0)),
                "busy_cost": usd_text(figures.get("busy_nano_usd", 0)),
            }
        )
    return rows


def _known_sum(values: Any) -> int | None:
    """The sum of what is known; None when nothing is (no agent said)."""
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def _totals(pools: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The pools' GPUs, CPUs, workers and nodes summed by environment or GPU class."""
    totals: dict[str, dict[str, Any]] = {}
    for pool in pools:
        row = totals.setdefault(
            pool[key],
            {key: pool[key], "pools": 0, "capacity": 0, "used": 0.0, "workers": 0},
        )
        row["pools"] += 1
        row["capacity"] += pool["capacity"]
        row["used"] = round(row["used"] + pool["used"], 3)
        row["workers"] += pool["workers"]
        for count in ("cpus", "cpus_in_use", "nodes"):
            row[count] = _known_sum([row.get(count), pool[count]])
    for row in totals.values():
        row["free"] = round(max(row["capacity"] - row["used"], 0), 3)
    return list(totals.values())
