"""Run segments: every run of a task goes to the ledger when it stops, preempted runs included."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.metering.ledger import gpu_hours
from apps.metering.models import LedgerEvent
from apps.resources.models import Pool
from apps.scheduling.models import Task, TaskState
from apps.scheduling.services import transition
from tests.world import World

pytestmark = pytest.mark.django_db


def run(task: Task, pool: Pool, minutes_ago: int) -> Task:
    for state in (TaskState.PLACED, TaskState.DISPATCHING):
        task = transition(task, to_state=state, actor="scheduler", pool=pool)
    started = timezone.now() - timedelta(minutes=minutes_ago)
    return transition(task, to_state=TaskState.RUNNING, actor="agent", started_at=started)


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
    from apps.metering import services

    with schema_context("acme"):
        first = services.gateway_calls()
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
        assert services.gateway_calls().accepted == 0
        now = timezone.now() + timedelta(hours=2)
        kept = services.storage(now=now)
        assert kept.accepted >= 1
        output = LedgerEvent.objects.filter(kind="storage").order_by("started_at").last()
        assert output is not None
        assert output.byte_ms == 14 * ((output.ended_at - output.started_at) // timedelta(milliseconds=1))
        assert services.storage(now=now).accepted == 0
