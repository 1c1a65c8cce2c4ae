"""How long the dashboard takes to find idle GPUs, beside reading every metric report's JSON.

On a fresh database with the demo tenant: N running tasks, each with an hour of metric reports from its
node (one every 10 seconds, 8 GPUs each: 200 tasks make 72,000 reports and 576,000 GPU samples), kept as
the plane keeps them (each report's GPU samples counted and summed as it is saved), a quarter of the
tasks idling under 80%. Then, five times each, the median of:

- baseline: the average of each running task's samples of the last hour, read from the reports' JSON
  (`jsonb_array_elements` over `values.gpus`), which is how the dashboard found them before;
- Klique: the dashboard's query (`apps.portal.dashboard.IDLE_SQL`), from the counts and sums kept with
  each report.

Both must name the same tasks with the same averages. Prints the seconds of each and
`ratio: <Klique's seconds> / <baseline's seconds>` (lower is better).

Usage: .venv/bin/python bench/idle_gpus.py [--tasks 200]
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

from scratch import scratch_django

REPORT_EVERY = timedelta(seconds=10)
GPUS = 8

# The average over each running task's samples, read from the JSON of its reports.
FROM_JSON = """
SELECT report.task_id, avg((gpu ->> 'utilization_percent')::double precision)
FROM fleet_taskreport report
JOIN scheduling_task task ON task.id = report.task_id AND task.state = 'running'
CROSS JOIN LATERAL jsonb_array_elements(
    CASE WHEN jsonb_typeof(report.body -> 'values' -> 'gpus') = 'array'
         THEN report.body -> 'values' -> 'gpus' ELSE '[]'::jsonb END
) AS gpu
WHERE report.kind = 'metric' AND report.at >= %s
  AND jsonb_typeof(gpu -> 'utilization_percent') = 'number'
GROUP BY report.task_id
HAVING avg((gpu ->> 'utilization_percent')::double precision) < %s
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    args = parser.parse_args()
    with scratch_django(redis_db=13) as demo:
        return measure(args.tasks, demo["tenant"])


def seed(count: int) -> Any:
    """COUNT running tasks with an hour of metric reports each; returns the time the dashboard reads at."""
    from django.db import connection
    from django.utils import timezone

    from apps.accounts.models import User
    from apps.fleet.models import TaskReport, gpu_utilization
    from apps.resources.models import ComputeResource, Pool
    from apps.scheduling.models import Task, TaskState

    rng = random.Random(9)
    now = timezone.now()
    resource, pool = ComputeResource.objects.first(), Pool.objects.first()
    submitter = User.objects.get(username="bob")
    samples = int(timedelta(hours=1) / REPORT_EVERY)
    for index in range(count):
        task = Task.objects.create(
            name=f"bench-{index}",
            compute_resource=resource,
            compute_resource_name=resource.name if resource else "",
            submitter=submitter,
            size_units=840 * GPUS,
            state=TaskState.RUNNING,
            pool=pool,
            submitted_at=now,
            queued_at=now,
        )
        busy = (70, 100) if index % 4 else (0, 40)
        reports = []
        for sample in range(samples):
            gpus = [{"index": gpu, "utilization_percent": rng.uniform(*busy)} for gpu in range(GPUS)]
            body = {"values": {"gpus": gpus}}
            kept = TaskReport(task=task, source="node-0", seq=sample, kind="metric", body=body)
            kept.at = now - REPORT_EVERY * (samples - sample) + timedelta(seconds=1)
            kept.gpu_samples, kept.gpu_percent_sum = gpu_utilization(body)  # what save() does
            reports.append(kept)
        TaskReport.objects.bulk_create(reports)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE fleet_taskreport; ANALYZE scheduling_task")
    return now


def timed(sql: str, parameters: list[Any]) -> tuple[float, dict[Any, float]]:
    from django.db import connection

    began = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(sql, parameters)
        found = dict(cursor.fetchall())
    return time.perf_counter() - began, found


def measure(count: int, schema: str) -> int:
    from django_tenants.utils import schema_context

    from apps.portal.dashboard import IDLE_BELOW, IDLE_SQL

    with schema_context(schema):
        began = time.perf_counter()
        now = seed(count)
        seeded = time.perf_counter() - began
        parameters = [now - timedelta(hours=1), IDLE_BELOW]
        baseline, klique = [], []
        for _ in range(5):
            seconds, from_json = timed(FROM_JSON, parameters)
            baseline.append(seconds)
            seconds, kept = timed(IDLE_SQL, parameters)
            klique.append(seconds)
            assert kept.keys() == from_json.keys(), (len(kept), len(from_json))
            assert all(abs(kept[task] - from_json[task]) < 1e-6 for task in kept)
    reports = count * int(timedelta(hours=1) / REPORT_EVERY)
    idle_seconds, json_seconds = statistics.median(klique), statistics.median(baseline)
    print(f"{count} running tasks, {reports:,} metric reports in the hour ({reports * GPUS:,} GPU samples)")
    print(f"seeded in {seeded:.1f} s; {len(kept)} tasks idle under {IDLE_BELOW:g}%, as both queries found")
    print(f"{'':48}{'seconds (median of 5)':>22}")
    print(f"{'baseline: every report JSON, expanded':48}{json_seconds:>22.3f}")
    print(f"{'Klique: counts and sums kept with each report':48}{idle_seconds:>22.3f}")
    print(f"ratio: {idle_seconds / json_seconds:.3f} ({idle_seconds:.3f} s / {json_seconds:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
