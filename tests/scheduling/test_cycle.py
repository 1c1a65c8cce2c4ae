"""The scheduling cycle against the database: decisions written, reclaim, and exactly-once placement."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.metering.models import LedgerEvent
from apps.provider.services import tenant_delete
from apps.resources.models import ComputeResource, Pool
from apps.scheduling import engine
from apps.scheduling.cycle import _apply, run_cycle
from apps.scheduling.lifecycle import transition
from apps.scheduling.models import Task, TaskEvent, TaskState
from apps.scheduling.reads import snapshot
from apps.scheduling.services import TaskRequest, tasks_submit
from tenants.models import Tenant
from tests.scheduling.config import acme_tenant
from tests.world import World


def running_task(resource: ComputeResource, pool: Pool, user: User, started_minutes_ago: int) -> Task:
    now = timezone.now()
    started = now - timedelta(minutes=started_minutes_ago)
    return Task.objects.create(
        compute_resource=resource,
        compute_resource_name=resource.name,
        submitter=user,
        size_units=resource.profile.size_units,
        state=TaskState.RUNNING,
        pool=pool,
        submitted_at=started,
        queued_at=started,
        placed_at=started,
        started_at=started,
    )


def test_research_reclaims_dev_s_borrowed_gpus_through_the_database(world: World, db: None) -> None:
    """Dev (queuing priority 10) borrowed all 16 GPUs; Research, under its reservation, gets 4 back."""
    with schema_context("acme"):
        Task.objects.all().delete()
        dev = ComputeResource.objects.get(name="Dev: 4 GPUs")
        carol = User.objects.get(username="carol")
        pools = {pool.name: pool for pool in Pool.objects.all()}
        victims = [
            running_task(dev, pools["baremetal"], carol, 40),
            running_task(dev, pools["baremetal"], carol, 10),
            running_task(dev, pools["h100"], carol, 30),
            running_task(dev, pools["h100"], carol, 20),
        ]
        bob = User.objects.get(username="bob")
        (research,) = tasks_submit(
            tenant=world.tenant_a, user=bob, requests=[TaskRequest(compute_resource="Research: 4 GPUs")]
        )
        result = run_cycle(world.tenant_a)
        assert (result.placed, result.preempted) == (1, 1)
        research.refresh_from_db()
        assert (research.state, research.pool.name if research.pool else None) == ("placed", "baremetal")
        # The most recently started of Dev's work in the first pool of the order.
        preempted = Task.objects.get(pk=victims[1].pk)
        assert preempted.state == TaskState.QUEUED
        assert preempted.reason_code == "preempted"
        assert preempted.submitted_at == victims[1].submitted_at  # back at the front of its queue
        moves = list(preempted.events.values_list("from_state", "to_state"))
        assert moves == [("running", "preempted"), ("preempted", "queued")]
        assert Task.objects.filter(state=TaskState.RUNNING).count() == 3
        # The preempted run went to the usage ledger as a segment of its own: 10 minutes of 4 GPUs.
        (segment,) = LedgerEvent.objects.filter(event_id__startswith=f"gpu:{preempted.pk}:")
        assert (segment.username, segment.pool, segment.group_name, segment.gpu_units) == (
            "carol",
            "baremetal",
            "dev",
            3360,
        )
        assert abs(segment.gpu_unit_ms - 3360 * 600_000) < 3360 * 5_000  # within a few seconds of 10 minutes


def test_a_second_cycle_on_the_same_state_changes_nothing(world: World, db: None) -> None:
    with schema_context("acme"):
        first = run_cycle(world.tenant_a)
        second = run_cycle(world.tenant_a)
    assert first.placed == 1
    assert (second.placed, second.preempted) == (0, 0)


def test_a_cycle_with_nothing_to_change_writes_nothing(world: World, db: None) -> None:
    """Its commit then waits for no flush of the write-ahead log: a tenant's cycles at rest cost reads."""
    with schema_context("acme"):
        run_cycle(world.tenant_a)  # places acme's queued task and publishes its GPUs in use
        with CaptureQueriesContext(connection) as queries:
            run_cycle(world.tenant_a)
    written = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].lstrip().startswith(("UPDATE", "INSERT", "DELETE"))
    ]
    assert written == []


def test_writing_one_decision_twice_places_each_task_once(world: World, db: None) -> None:
    with schema_context("acme"):
        now = timezone.now()
        state, shown = snapshot(world.tenant_a, now)
        decision = engine.schedule(state)
        assert _apply(decision, now, shown) == (1, 0, [])
        assert _apply(decision, now, shown) == (0, 0, [])
        assert TaskEvent.objects.filter(task_id=world.task_a, to_state=TaskState.PLACED).count() == 1


@pytest.fixture
def committed_tenant(django_db_blocker: pytest.FixtureRequest, world: World) -> Iterator[Tenant]:
    """A tenant whose rows are really committed, so that several connections can see them."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        tenant = acme_tenant(slug="concurrent", name="Concurrent", admin="olga")
        with schema_context("concurrent"):
            olga = User.objects.get(username="olga")
            tasks_submit(
                tenant=tenant,
                user=olga,
                requests=[TaskRequest(compute_resource="Research: 4 GPUs", name=f"t{i}") for i in range(40)],
            )
        yield tenant
        tenant_delete(tenant=Tenant.objects.get(slug="concurrent"))


def test_two_cycles_at_once_never_place_a_task_twice(committed_tenant: Tenant) -> None:
    barrier = threading.Barrier(2)
    results = []

    def cycle() -> None:
        try:
            with schema_context("concurrent"):
                barrier.wait()
                results.append(run_cycle(committed_tenant))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=cycle) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    with schema_context("concurrent"):
        placements = list(
            TaskEvent.objects.filter(to_state=TaskState.PLACED).values_list("task_id", flat=True)
        )
        placed_tasks = Task.objects.filter(state=TaskState.PLACED).count()
        used = sum(Task.objects.filter(state=TaskState.PLACED).values_list("size_units", flat=True))
    assert len(results) == 2
    assert len(placements) == len(set(placements)) == placed_tasks == 4  # the research limit: 16 GPUs
    assert used == 16 * engine.UNITS_PER_GPU
    assert sum(result.placed for result in results) == 4


def until_a_connection_waits_for_a_lock(seconds: float = 10) -> bool:
    with connection.cursor() as cursor:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # a transaction would see its first one
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            if cursor.fetchone()[0]:
                return True
            time.sleep(0.05)
    return False


def test_a_cycle_preempting_two_runs_and_an_agent_ending_one_of_them_both_go_through(
    committed_tenant: Tenant, django_db_blocker: pytest.FixtureRequest
) -> None:
    """The cycle takes back two of Dev's runs while an agent, holding the second's row, reports that run's
    end. Both meter into the same rollups; neither may deadlock the other, and the ended run stays ended."""
    with django_db_blocker.unblock(), schema_context("concurrent"):  # type: ignore[attr-defined]
        Task.objects.all().delete()
        dev = ComputeResource.objects.get(name="Dev: 4 GPUs")
        olga = User.objects.get(username="olga")
        pools = {pool.name: pool for pool in Pool.objects.all()}
        for pool, minutes in (("baremetal", 40), ("baremetal", 10), ("h100", 30), ("h100", 20)):
            running_task(dev, pools[pool], olga, minutes)
        requests = [TaskRequest(compute_resource="Research: 4 GPUs", name=f"r{i}") for i in range(2)]
        tasks_submit(tenant=committed_tenant, user=olga, requests=requests)
        decision = engine.schedule(snapshot(committed_tenant, timezone.now())[0])
    first, second = (str(preemption.victim) for preemption in decision.preemptions)

    locked, errors, results = threading.Event(), [], []

    def agent_reports_the_second_run_ended() -> None:
        try:
            with schema_context("concurrent"), transaction.atomic():
                task = Task.objects.select_for_update().get(pk=second)
                locked.set()
                assert until_a_connection_waits_for_a_lock(), "the cycle never waited for the run's row"
                transition(task, to_state=TaskState.COMPLETED, actor="agent", exit_code=0)
        except Exception as error:
            errors.append(error)
        finally:
            connections.close_all()

    def cycle() -> None:
        try:
            locked.wait(timeout=30)
            with schema_context("concurrent"):
                results.append(run_cycle(committed_tenant))
        except Exception as error:
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=agent_reports_the_second_run_ended), threading.Thread(target=cycle)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert [(result.ran, result.preempted) for result in results] == [(True, 1)]
    with django_db_blocker.unblock(), schema_context("concurrent"):  # type: ignore[attr-defined]
        states = dict(Task.objects.filter(pk__in=[first, second]).values_list("pk", "state"))
        assert {str(pk): state for pk, state in states.items()} == {
            first: TaskState.QUEUED,
            second: TaskState.COMPLETED,
        }
        moves = list(TaskEvent.objects.filter(task_id=second).values_list("to_state", flat=True))
        assert moves == [TaskState.COMPLETED]  # not preempted after it ended
        segments = LedgerEvent.objects.filter(event_id__startswith="gpu:").values_list("event_id", flat=True)
        assert sorted(event_id.split(":")[1] for event_id in segments) == sorted([first, second])
