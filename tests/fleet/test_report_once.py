"""A report is kept once per run, source and number, in one statement that a replay cannot abort.

`TaskReport.insert_once` is `INSERT … ON CONFLICT DO NOTHING`: a replay changes nothing and leaves the
transaction usable, which a bare INSERT's IntegrityError would not (it needed a savepoint, three round
trips, on every report of every task)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import transaction
from django_tenants.utils import schema_context

from apps.fleet.models import TaskReport
from apps.scheduling.models import Task
from tests.world import World

LEASE = uuid.uuid4()


def report(task: Task, **fields: Any) -> TaskReport:
    values: dict[str, Any] = {"source": "agent", "lease_id": LEASE, "seq": 1, "kind": "log", "body": {}}
    return TaskReport(task=task, **{**values, **fields})


@pytest.mark.parametrize(
    ("first", "again"),
    [
        ({}, {}),  # the same message twice
        ({"body": {"lines": ["a"]}}, {"body": {"lines": ["b"]}}),  # same number, other text: still a replay
        ({"kind": "status"}, {"kind": "log"}),  # the number decides, not the kind
        ({"lease_id": None}, {"lease_id": None}),  # reports from before leases: no lease is one lease
        ({"source": "node-3", "seq": 7}, {"source": "node-3", "seq": 7}),
    ],
)
def test_a_replay_is_refused_and_the_transaction_goes_on(
    world: World, db: None, first: dict[str, Any], again: dict[str, Any]
) -> None:
    with schema_context("acme"), transaction.atomic():
        task = Task.objects.get(pk=world.task_a)
        kept = report(task, **first)
        assert kept.insert_once()
        assert kept.pk is not None
        assert TaskReport.objects.get(pk=kept.pk).body == kept.body
        replay = report(task, **again)
        assert not replay.insert_once()
        assert replay.pk is None
        # Not aborted: the same transaction still reads and writes.
        assert TaskReport.objects.filter(task=task).count() == 1
        assert report(task, **{**again, "seq": 99}).insert_once()


@pytest.mark.parametrize(
    "other",
    [{"seq": 2}, {"source": "node-0"}, {"lease_id": uuid.uuid4()}, {"lease_id": None}],
)
def test_another_run_source_or_number_is_kept(world: World, db: None, other: dict[str, Any]) -> None:
    with schema_context("acme"):
        task = Task.objects.get(pk=world.task_a)
        assert report(task).insert_once()
        assert report(task, **other).insert_once()
        assert TaskReport.objects.filter(task=task).count() == 2


def test_a_metric_report_counts_its_gpu_samples(world: World, db: None) -> None:
    body = {"values": {"gpus": [{"utilization_percent": 40}, {"utilization_percent": 60.5}, {"x": 1}]}}
    with schema_context("acme"):
        task = Task.objects.get(pk=world.task_a)
        kept = report(task, kind="metric", body=body)
        assert kept.insert_once()
        stored = TaskReport.objects.get(pk=kept.pk)
        assert (stored.gpu_samples, stored.gpu_percent_sum) == (2, 100.5)
        assert stored.at is not None
