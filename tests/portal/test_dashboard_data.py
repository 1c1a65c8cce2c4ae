"""The dashboard's figures from the database, without a browser: idle GPUs from agents' metric reports,
however malformed some reports are."""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from django_tenants.utils import schema_context

from tests.world import World

pytestmark = pytest.mark.django_db


def _task(world: World, name: str, state: str) -> Any:
    """A task of bob's in acme's first pool, in the state given."""
    from apps.resources.models import ComputeResource, Pool
    from apps.scheduling.models import Task

    resource, now = ComputeResource.objects.first(), timezone.now()
    assert resource is not None
    return Task.objects.create(
        name=name,
        compute_resource=resource,
        compute_resource_name=resource.name,
        submitter_id=world.users["bob"],
        size_units=840,
        state=state,
        pool=Pool.objects.first(),
        submitted_at=now,
        queued_at=now,
    )


def test_idle_gpus_average_the_well_formed_samples_of_the_last_hour_only(world: World) -> None:
    from apps.fleet.models import TaskReport
    from apps.portal.dashboard import idle_tasks
    from apps.scheduling.models import TaskState

    with schema_context("acme"):
        now = timezone.now()
        busy, idle = _task(world, "busy", TaskState.RUNNING), _task(world, "idle", TaskState.RUNNING)
        ended = _task(world, "ended", TaskState.COMPLETED)
        bodies = [
            (idle, {"values": {"gpus": [{"utilization_percent": 10}, {"utilization_percent": 30.5}]}}, 1),
            (idle, {"values": {"gpus": [{"utilization_percent": "high"}, 7, None]}}, 1),  # no number: skipped
            (idle, {"values": {"gpus": {"utilization_percent": 0}}}, 1),  # not a list: skipped
            (idle, {"values": "broken"}, 1),
            (idle, {"values": {"gpus": [{"utilization_percent": 0}]}}, 120),  # over an hour ago
            (busy, {"values": {"gpus": [{"utilization_percent": 95}]}}, 1),
            (ended, {"values": {"gpus": [{"utilization_percent": 0}]}}, 1),  # not running
            (idle, {"values": {"gpus": [{"utilization_percent": True}]}}, 1),  # a boolean is no number
        ]
        for seq, (task, body, minutes) in enumerate(bodies):
            TaskReport.objects.create(
                task=task,
                source="agent",
                seq=seq,
                kind="metric",
                body=body,
                at=now - timedelta(minutes=minutes),
            )
        found = idle_tasks(now)
    assert [(row["task"].name, row["average"]) for row in found] == [("idle", 20.2)]


def test_a_reports_gpu_samples_are_counted_when_it_is_kept_as_the_migration_counted_older_ones(
    world: World,
) -> None:
    """The counts and sums the dashboard averages: from TaskReport.save() for new reports, and from the
    migration's SQL for reports kept before it, the same for well-formed and malformed bodies."""
    from django.db import connection

    from apps.fleet.models import TaskReport
    from apps.scheduling.models import TaskState

    backfill = importlib.import_module("apps.fleet.migrations.0005_gpu_samples").BACKFILL
    bodies = [
        {"values": {"gpus": [{"utilization_percent": 10}, {"utilization_percent": 30.5}]}},
        {"values": {"gpus": [{"utilization_percent": "high"}, 7, None, {"utilization_percent": 50}]}},
        {"values": {"gpus": [{"utilization_percent": True}, {"memory_used_mib": 10}]}},
        {"values": {"gpus": {"utilization_percent": 0}}},
        {"values": "broken"},
        {"loss": 0.5},
        [],
    ]
    with schema_context("acme"):
        task = _task(world, "sampled", TaskState.RUNNING)
        kept = [
            TaskReport.objects.create(task=task, source="agent", seq=seq, kind="metric", body=body)
            for seq, body in enumerate(bodies)
        ]
        log = TaskReport.objects.create(task=task, source="agent", seq=99, kind="log", body=bodies[0])
        on_save = {
            report.pk: (report.gpu_samples, report.gpu_percent_sum)
            for report in TaskReport.objects.filter(task=task)
        }
        TaskReport.objects.filter(task=task).update(gpu_samples=0, gpu_percent_sum=0.0)
        with connection.cursor() as cursor:
            cursor.execute(backfill)
        by_migration = {
            report.pk: (report.gpu_samples, report.gpu_percent_sum)
            for report in TaskReport.objects.filter(task=task)
        }
    assert [on_save[report.pk] for report in kept] == [
        (2, 40.5),
        (1, 50.0),
        (0, 0.0),
        (0, 0.0),
        (0, 0.0),
        (0, 0.0),
        (0, 0.0),
    ]
    assert on_save[log.pk] == (0, 0.0)  # only metric reports carry samples
    assert by_migration == on_save


def test_a_tasks_page_shows_the_gpu_time_metered_so_far_hour_by_hour(world: World, client: Client) -> None:
    """A running task's facts name the GPU-hours and cost its runs have in the ledger, which grow by the
    hour while it runs."""
    from apps.accounts.models import User
    from apps.metering.models import PriceBook
    from apps.scheduling.meter import meter_running
    from apps.scheduling.models import TaskState
    from tests.world import HOST_A

    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    with schema_context("acme"):
        PriceBook.objects.update_or_create(pk=1, defaults={"gpu_hour": {"*": "2.50"}})
        task = _task(world, "long", TaskState.RUNNING)
        task.submitted_at = task.queued_at = hour - timedelta(hours=3, minutes=5)
        task.started_at = hour - timedelta(hours=3)
        task.save()
        client.force_login(User.objects.get(username="bob"))

        def facts() -> str:
            answer = client.get(f"/portal/tasks/{task.pk}/facts/", HTTP_HOST=HOST_A)
            assert answer.status_code == 200
            return answer.content.decode()

        assert "GPU time metered" not in facts()  # nothing in the ledger yet
        assert meter_running(now=hour - timedelta(hours=1)) == 2
        assert "2.00 GPU-hours, 5.00 USD (so far: hour by hour while it runs)" in facts()
        assert meter_running(now=hour) == 1
        assert "3.00 GPU-hours, 7.50 USD" in facts()
