"""Run segments: every run of a task goes to the ledger hour by hour while it runs and the rest when it
stops, preempted runs included."""

from __future__ import annotations

import itertools
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.metering.ledger import gpu_hours
from apps.metering.models import LedgerEvent
from apps.resources.models import Pool
from apps.scheduling.lifecycle import transition
from apps.scheduling.meter import meter_running
from apps.scheduling.models import Task, TaskState
from tests.world import World

pytestmark = pytest.mark.django_db


def run(task: Task, pool: Pool, minutes_ago: int = 0, started: datetime | None = None) -> Task:
    for state in (TaskState.PLACED, TaskState.DISPATCHING):
        task = transition(task, to_state=state, actor="scheduler", pool=pool)
    started = started or timezone.now() - timedelta(minutes=minutes_ago)
    return transition(task, to_state=TaskState.RUNNING, actor="agent", started_at=started)


def segments_of(task: Task) -> list[LedgerEvent]:
    return list(LedgerEvent.objects.filter(event_id__startswith=f"gpu:{task.pk}:").order_by("started_at"))


def test_a_long_run_is_metered_hour_by_hour_while_it_runs_and_the_rest_when_it_stops(
    world: World, django_assert_num_queries: Any
) -> None:
    from apps.metering.models import Rollup
    from apps.scheduling.tasks import meter_running as running_gpus

    hour, ms = timezone.now().replace(minute=0, second=0, microsecond=0), timedelta(milliseconds=1)
    with schema_context("acme"):
        started = hour - timedelta(hours=3, minutes=20)
        task = run(Task.objects.get(pk=world.task_a), Pool.objects.get(name="h100"), started=started)
        gpus = task.size_units / 840

        assert meter_running(now=hour - timedelta(minutes=50)) == 3  # 20 minutes, then two whole hours
        with django_assert_num_queries(1):  # a second pass finds nothing due: one query (the path is set)
            assert meter_running(now=hour - timedelta(minutes=50)) == 0
        assert [(s.started_at, s.ended_at) for s in segments_of(task)] == [
            (started, hour - timedelta(hours=3) - ms),
            (hour - timedelta(hours=3) - ms, hour - timedelta(hours=2) - ms),
            (hour - timedelta(hours=2) - ms, hour - timedelta(hours=1) - ms),
        ]
        # Each hour's GPU time is in that hour's rollup, where the dashboard's utilization chart reads it.
        hourly = dict(
            Rollup.objects.filter(grain="hour", kind="gpu", bucket__lt=hour).values_list(
                "bucket", "gpu_unit_ms"
            )
        )
        assert {bucket: float(gpu_hours(unit_ms)) for bucket, unit_ms in hourly.items()} == pytest.approx(
            {
                hour - timedelta(hours=4): gpus * 20 / 60,
                hour - timedelta(hours=3): gpus,
                hour - timedelta(hours=2): gpus,
            }
        )

        written = running_gpus("acme")  # through Celery's task, as beat sends it: the last hour
        assert written == 1 + (timezone.now() - hour) // timedelta(hours=1)

        task = transition(Task.objects.get(pk=task.pk), to_state=TaskState.COMPLETED, actor="agent")
        assert task.ended_at is not None
        segments = segments_of(task)
        assert len(segments) == 4 + written
        assert segments[-1].ended_at == task.ended_at  # the rest, from where hourly metering was
        assert all(a.ended_at == b.started_at for a, b in itertools.pairwise(segments))
        run_ms = (task.ended_at - started) // ms
        assert sum(s.gpu_unit_ms for s in segments) == task.size_units * run_ms  # to the millisecond
        assert meter_running() == 0  # a stopped run is not metered again


def test_a_run_after_a_preemption_is_metered_from_its_own_start(world: World) -> None:
    hour, ms = timezone.now().replace(minute=0, second=0, microsecond=0), timedelta(milliseconds=1)
    with schema_context("acme"):
        h100 = Pool.objects.get(name="h100")
        task = run(Task.objects.get(pk=world.task_a), h100, started=hour - timedelta(hours=3))
        assert meter_running(now=hour) == 3
        task = transition(task, to_state=TaskState.PREEMPTED, actor="scheduler")
        first_run = segments_of(task)
        assert len(first_run) == 4  # its three hours, and the rest when it was preempted
        assert first_run[-1].started_at == hour - ms
        task = transition(task, to_state=TaskState.QUEUED, actor="scheduler", started_at=None)
        task = run(task, h100)
        second = task.started_at
        assert second is not None
        assert meter_running(now=hour + timedelta(hours=2, minutes=5)) == 2
        ours = [s for s in segments_of(task) if s.started_at >= second]
        assert [(s.started_at, s.ended_at) for s in ours] == [
            (second, hour + timedelta(hours=1) - ms),
            (hour + timedelta(hours=1) - ms, hour + timedelta(hours=2) - ms),
        ]


def test_a_metering_pass_gives_way_to_a_transaction_that_holds_what_it_needs(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """Another connection holds the rollups (as a scheduling cycle stopping a run would, mid-transaction):
    the pass leaves the run to the next one instead of waiting, and the next one meters it."""
    import psycopg
    from django.db import connection

    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    database = connection.settings_dict
    with schema_context("acme"):
        task = run(
            Task.objects.get(pk=world.task_a),
            Pool.objects.get(name="h100"),
            started=hour - timedelta(hours=2),
        )
        with psycopg.connect(
            dbname=database["NAME"], host=database["HOST"], port=database["PORT"], user=database["USER"]
        ) as other:
            other.execute("LOCK TABLE acme.metering_rollup IN EXCLUSIVE MODE")
            began = time.monotonic()
            assert meter_running(now=hour) == 0
            assert time.monotonic() - began < 5  # it waited its lock timeout, not for the other to end
            assert segments_of(task) == []
            assert f"run of task {task.pk} left to the next metering pass" in caplog.text
        assert meter_running(now=hour) == 2  # the other let go: the next pass meters both hours


def test_a_task_preempted_twice_leaves_three_segments_that_add_up_to_its_gpu_time(world: World) -> None:
    with schema_context("acme"):
        task = Task.objects.get(pk=world.task_a)
        h100 = Pool.objects.get(name="h100")
        expected_ms = 0
        for minutes, end in ((90, TaskState.PREEMPTED), (60, TaskState.PREEMPTED), (30, TaskState.COMPLETED)):
            task = run(task, h100, minutes)
            started = task.started_at
            assert started is not None
            task = transition(task, to_state=end, actor="scheduler")
            ended = LedgerEvent.objects.get(event_id=f"gpu:{task.pk}:{started.isoformat()}").ended_at
            expected_ms += (ended - started) // timedelta(milliseconds=1)
            if end == TaskState.PREEMPTED:
                task = transition(task, to_state=TaskState.QUEUED, actor="scheduler", started_at=None)
        segments = LedgerEvent.objects.filter(event_id__startswith=f"gpu:{task.pk}:").order_by("started_at")
        assert segments.count() == 3
        units = task.size_units
        assert {(s.kind, s.pool, s.gpu_class, s.username, s.project_name, s.gpu_units) for s in segments} == {
            ("gpu", "h100", "H100", "bob", "", units)
        }
        assert {s.group_name for s in segments} == {"research"}
        total = sum(s.gpu_unit_ms for s in segments)
        assert total == units * expected_ms
        assert float(gpu_hours(total)) == pytest.approx((units / 840) * 3, rel=1e-3)  # 1.5 h + 1 h + 0.5 h


def test_a_run_that_never_started_is_not_metered(world: World) -> None:
    with schema_context("acme"):
        task = Task.objects.get(pk=world.task_a)
        task = transition(
            task, to_state=TaskState.PLACED, actor="scheduler", pool=Pool.objects.get(name="h100")
        )
        transition(task, to_state=TaskState.ABORTED, actor=User.objects.get(username="bob").username)
        assert not LedgerEvent.objects.filter(event_id__startswith=f"gpu:{task.pk}:").exists()


def test_gateway_calls_and_kept_outputs_reach_the_ledger_once(world: World) -> None:
    from apps.fleet.outputs import meter_outputs
    from gateway.services import meter_calls

    with schema_context("acme"):
        first = meter_calls()
        assert (first.accepted, first.rejected) == (1, [])  # the world's one call by bob
        call = LedgerEvent.objects.get(event_id=world.usage_a)
        assert (call.kind, call.username, call.project_name, call.tokens_in, call.tokens_out) == (
            "tokens",
            "bob",
            "apollo",
            12,
            30,
        )
        assert call.cost_nano_usd == 72_000  # no price in the book: the gateway's own cost
        assert meter_calls().accepted == 0
        now = timezone.now() + timedelta(hours=2)
        kept = meter_outputs(now=now)
        assert kept.accepted >= 1
        output = LedgerEvent.objects.filter(kind="storage").order_by("started_at").last()
        assert output is not None
        assert output.byte_ms == 14 * ((output.ended_at - output.started_at) // timedelta(milliseconds=1))
        assert meter_outputs(now=now).accepted == 0
