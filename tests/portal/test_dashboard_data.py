"""The dashboard's figures from the database, without a browser: idle GPUs from agents' metric reports,
however malformed some reports are."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context

from tests.world import World

pytestmark = pytest.mark.django_db


def test_idle_gpus_average_the_well_formed_samples_of_the_last_hour_only(world: World) -> None:
    from apps.fleet.models import TaskReport
    from apps.portal.views import _idle
    from apps.resources.models import ComputeResource, Pool
    from apps.scheduling.models import Task, TaskState

    with schema_context("acme"):
        now = timezone.now()
        resource = ComputeResource.objects.first()
        assert resource is not None

        def running(name: str, state: str = TaskState.RUNNING) -> Task:
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

        busy, idle, ended = running("busy"), running("idle"), running("ended", TaskState.COMPLETED)
        bodies = [
            (idle, {"values": {"gpus": [{"utilization_percent": 10}, {"utilization_percent": 30.5}]}}, 1),
            (idle, {"values": {"gpus": [{"utilization_percent": "high"}, 7, None]}}, 1),  # no number: skipped
            (idle, {"values": {"gpus": {"utilization_percent": 0}}}, 1),  # not a list: skipped
            (idle, {"values": "broken"}, 1),
            (idle, {"values": {"gpus": [{"utilization_percent": 0}]}}, 120),  # over an hour ago
            (busy, {"values": {"gpus": [{"utilization_percent": 95}]}}, 1),
            (ended, {"values": {"gpus": [{"utilization_percent": 0}]}}, 1),  # not running
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
        found = _idle(now)
    assert [(row["task"].name, row["average"]) for row in found] == [("idle", 20.2)]
