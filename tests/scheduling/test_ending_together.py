"""Runs that end together (an agent's burst of results, a cycle's preemptions) are metered in one write to
the ledger, and what their GPUs go to next is decided once, after them all: the same segments, wallets and
cycles as runs ending one by one, in a few statements instead of a few per run."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.metering.models import LedgerEvent, PriceBook
from apps.metering.signals import cost_recorded
from apps.resources.models import ComputeResource, Pool
from apps.scheduling import wake
from apps.scheduling.lifecycle import ending_together, task_finish, transition
from apps.scheduling.meter import meter_running, segments_together
from apps.scheduling.models import Task, TaskState
from apps.scheduling.services import TaskRequest, tasks_submit
from tests.world import World

pytestmark = pytest.mark.django_db


def running(world: World, who: str, resource: str, pool: str, minutes: int) -> Task:
    """A task of `who` on `resource`, running in `pool` since `minutes` ago."""
    asked = [TaskRequest(compute_resource=resource)]
    (task,) = tasks_submit(tenant=world.tenant_a, user=User.objects.get(username=who), requests=asked)
    for state in (TaskState.PLACED, TaskState.DISPATCHING):
        task = transition(task, to_state=state, actor="scheduler", pool=Pool.objects.get(name=pool))
    started = timezone.now() - timedelta(minutes=minutes)
    return transition(task, to_state=TaskState.RUNNING, actor="agent", started_at=started)


def three_running(world: World) -> list[Task]:
    return [
        running(world, "bob", "Research: 4 GPUs", "h100", 30),
        running(world, "bob", "Research: 4 GPUs", "baremetal", 20),
        running(world, "carol", "Dev: 4 GPUs", "baremetal", 10),
    ]


def segments_of(task: Task) -> list[LedgerEvent]:
    return list(LedgerEvent.objects.filter(event_id__startswith=f"gpu:{task.pk}:").order_by("started_at"))


def finish(tenant: Any, task: Task, exit_code: int = 0) -> Task:
    return task_finish(tenant=tenant, task=task, succeeded=exit_code == 0, exit_code=exit_code, actor="agent")


def statements(queries: CaptureQueriesContext, *parts: str) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if all(part in q["sql"] for part in parts)]


def test_runs_ending_together_are_metered_in_one_write_each_with_its_own_segment(world: World) -> None:
    with schema_context("acme"):
        tasks = three_running(world)
        with CaptureQueriesContext(connection) as queries, transaction.atomic(), ending_together():
            ended = [finish(world.tenant_a, task) for task in tasks]
            assert [segments_of(task) for task in tasks] == [[], [], []]  # kept for the end of the block
        assert len(statements(queries, "INSERT INTO metering_ledgerevent")) == 1
        assert len(statements(queries, "WITH hours")) == 1  # the rollups, once
        assert len(statements(queries, "policy__group__name")) == 1  # the groups of all three, in one read
        assert not statements(queries, '"metered_until" AS "metered_until"')  # each task was read locked

        groups = {"Research: 4 GPUs": "research", "Dev: 4 GPUs": "dev"}
        for task, after in zip(tasks, ended, strict=True):
            (segment,) = segments_of(task)
            assert after.state == TaskState.COMPLETED
            assert (segment.started_at, segment.ended_at) == (task.started_at, after.ended_at)
            assert after.metered_until == after.ended_at
            assert segment.group_name == groups[task.compute_resource_name]
            assert task.pool is not None
            assert task.started_at is not None
            assert after.ended_at is not None
            assert (str(segment.user_id), segment.pool) == (str(task.submitter_id), task.pool.name)
            assert segment.gpu_units == task.size_units
            span = (after.ended_at - task.started_at) // timedelta(milliseconds=1)
            assert segment.gpu_unit_ms == task.size_units * span


def test_a_run_ending_alone_is_metered_as_one_ending_in_a_block(world: World) -> None:
    """The same segment, to the field, and the same charge to the wallets, whether the run's end was kept
    for a block or sent at once."""
    with schema_context("acme"):
        PriceBook.objects.update_or_create(pk=1, defaults={"gpu_hour": {"H100": "2.50"}})
        alone, together = (running(world, "carol", "Dev: 4 GPUs", "h100", 15) for _ in range(2))
        started, now = timezone.now() - timedelta(minutes=15), timezone.now()
        Task.objects.filter(pk__in=[alone.pk, together.pk]).update(started_at=started)
        with (
            mock.patch("apps.scheduling.lifecycle.timezone.now", return_value=now),
            mock.patch.object(cost_recorded, "send") as charged,
        ):
            finish(world.tenant_a, alone)
            with ending_together():
                finish(world.tenant_a, together)
        (one,), (other,) = segments_of(alone), segments_of(together)
        columns = ("group_name", "user_id", "username", "project_id", "pool", "gpu_class", "gpu_units")
        assert [getattr(one, c) for c in columns] == [getattr(other, c) for c in columns]
        assert (one.cost_nano_usd, one.gpu_unit_ms) == (other.cost_nano_usd, other.gpu_unit_ms)
        assert one.cost_nano_usd > 0
        first, second = (call.kwargs for call in charged.call_args_list)
        assert first == second
        assert (first["user_id"], first["cost_nano_usd"]) == (str(alone.submitter_id), one.cost_nano_usd)


def test_a_run_metered_hour_by_hour_ends_where_the_hourly_pass_left_it(world: World) -> None:
    """Read locked by its ender, a task's `metered_until` is the row's: the hours a pass wrote are not
    metered twice."""
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    with schema_context("acme"):
        task = running(world, "bob", "Research: 4 GPUs", "h100", 0)
        Task.objects.filter(pk=task.pk).update(started_at=hour - timedelta(hours=2, minutes=30))
        assert meter_running(now=hour + timedelta(minutes=1)) == 3  # the half hour, then two whole ones
        with transaction.atomic(), ending_together():
            locked = Task.objects.select_for_update().get(pk=task.pk)
            ended = task_finish(
                tenant=world.tenant_a, task=locked, succeeded=True, exit_code=0, actor="agent", locked=True
            )
        spans = [(s.started_at, s.ended_at) for s in segments_of(task)]
        assert len(spans) == 4
        assert spans[3] == (spans[2][1], ended.ended_at)  # from where the pass left it, to the end
        assert ended.ended_at is not None
        assert locked.started_at is not None
        assert sum((end - start for start, end in spans), timedelta()) == ended.ended_at - locked.started_at


def test_what_the_gpus_go_to_is_decided_once_after_the_runs_that_ended(world: World) -> None:
    with schema_context("acme"):
        tasks = three_running(world)
        assert Task.objects.filter(state=TaskState.QUEUED).exists()  # bob's first task waits
        with (
            mock.patch.object(wake, "request_cycle") as asked,
            CaptureQueriesContext(connection) as queries,
            transaction.atomic(),
            ending_together(),
        ):
            for task in tasks:
                finish(world.tenant_a, task)
            asked.assert_not_called()  # not before the last of them
        assert len(statements(queries, "scheduling_task", "'queued'", "LIMIT 1")) == 1
        asked.assert_called_once_with(world.tenant_a)


def test_with_nothing_waiting_the_gpus_in_use_are_shown_once_after_the_runs_that_ended(world: World) -> None:
    with schema_context("acme"):
        tasks = three_running(world)
        Task.objects.filter(state=TaskState.QUEUED).update(state=TaskState.ABORTED)
        with (
            mock.patch.object(wake, "request_cycle") as asked,
            CaptureQueriesContext(connection) as queries,
            transaction.atomic(),
            ending_together(),
        ):
            for task in tasks[:2]:
                finish(world.tenant_a, task)
        asked.assert_not_called()
        assert len(statements(queries, "gpu_units_in_use FROM")) == 1
        world.tenant_a.refresh_from_db()
        assert world.tenant_a.gpu_units_in_use == tasks[2].size_units  # the one still running


def test_a_block_left_by_an_error_sends_nothing_and_the_next_run_is_metered_at_once(world: World) -> None:
    with schema_context("acme"):
        first, second = three_running(world)[:2]

        def failed_burst() -> None:
            with transaction.atomic(), ending_together():
                finish(world.tenant_a, first)
                raise RuntimeError("the burst failed")

        with pytest.raises(RuntimeError):
            failed_burst()
        assert Task.objects.get(pk=first.pk).state == TaskState.RUNNING  # undone, with its segment
        assert segments_of(first) == []
        with transaction.atomic():
            finish(world.tenant_a, second)  # no block open any more: metered in its own transaction
            assert len(segments_of(second)) == 1


def test_a_block_within_a_block_is_the_outer_ones(world: World) -> None:
    with schema_context("acme"):
        first, second, third = three_running(world)
        with transaction.atomic(), ending_together():
            finish(world.tenant_a, first)
            with ending_together(), segments_together():
                finish(world.tenant_a, second)
            assert segments_of(first) == segments_of(second) == []  # the inner blocks sent nothing
            finish(world.tenant_a, third)
        assert [len(segments_of(task)) for task in (first, second, third)] == [1, 1, 1]


def test_a_retried_run_and_a_failed_one_are_metered_like_a_completed_one(world: World) -> None:
    with schema_context("acme"):
        retried, failed = three_running(world)[:2]
        Task.objects.filter(pk=failed.pk).update(attempts=1, max_attempts=1)  # the other: 0 of 3
        failed.refresh_from_db()
        with transaction.atomic(), ending_together():
            after_retry = finish(world.tenant_a, retried, exit_code=3)
            after_failure = finish(world.tenant_a, failed, exit_code=1)
        assert (after_retry.state, after_failure.state) == (TaskState.QUEUED, TaskState.FAILED)
        assert [len(segments_of(task)) for task in (retried, failed)] == [1, 1]


def test_resources_without_a_policy_group_meter_an_empty_group(world: World) -> None:
    with schema_context("acme"):
        task = running(world, "carol", "Dev: 4 GPUs", "h100", 5)
        Task.objects.filter(pk=task.pk).update(compute_resource=None)
        task.refresh_from_db()
        assert ComputeResource.objects.filter(name="Dev: 4 GPUs").exists()
        with transaction.atomic(), ending_together():
            finish(world.tenant_a, task)
        (segment,) = segments_of(task)
        assert segment.group_name == ""
