"""Task lifecycle beyond placement: retries, the transitions allowed, and event-triggered cycles."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import User
from apps.core.errors import InvalidInput
from apps.resources.models import Pool
from apps.scheduling import tasks as scheduling_tasks
from apps.scheduling import wake
from apps.scheduling.lifecycle import task_finish, transition
from apps.scheduling.models import Task, TaskState
from apps.scheduling.services import TaskRequest, tasks_submit
from config.celery import app as celery_app
from tenants.models import Tenant
from tests.world import World


def running(world: World) -> Task:
    with schema_context("acme"):
        task = Task.objects.get(pk=world.task_a)
        transition(task, to_state=TaskState.PLACED, actor="scheduler", pool=Pool.objects.get(name="h100"))
        transition(task, to_state=TaskState.DISPATCHING, actor="agent")
        return transition(task, to_state=TaskState.RUNNING, actor="agent", attempts=task.attempts + 1)


def test_a_failed_run_is_retried_until_its_attempts_are_spent(world: World, db: None) -> None:
    task = running(world)
    with schema_context("acme"):
        task = task_finish(tenant=world.tenant_a, task=task, succeeded=False, exit_code=3, actor="agent")
        assert (task.state, task.reason_code, task.pool_id) == (TaskState.QUEUED, "retrying", None)
        assert "exit code 3" in task.reason
        for attempt in (2, 3):
            transition(task, to_state=TaskState.PLACED, actor="scheduler", pool=Pool.objects.get(name="h100"))
            transition(task, to_state=TaskState.DISPATCHING, actor="agent")
            transition(task, to_state=TaskState.RUNNING, actor="agent", attempts=attempt)
            task = task_finish(tenant=world.tenant_a, task=task, succeeded=False, exit_code=1, actor="agent")
        assert (task.state, task.reason) == (
            TaskState.FAILED,
            "All 3 attempts failed; the last failed with exit code 1.",
        )
        assert task.ended_at is not None
        states = list(task.events.values_list("to_state", flat=True))
        assert states.count("failed") == 3
        assert states.count("queued") == 3  # submitted, then two retries


def test_a_finished_run_completes(world: World, db: None) -> None:
    task = running(world)
    with schema_context("acme"):
        task = task_finish(tenant=world.tenant_a, task=task, succeeded=True, exit_code=0, actor="agent")
    assert (task.state, task.exit_code) == (TaskState.COMPLETED, 0)


@pytest.mark.parametrize("waiting", [False, True], ids=["nothing waits", "work waits"])
def test_a_run_that_ends_asks_for_a_cycle_only_when_work_waits(
    world: World, db: None, monkeypatch: pytest.MonkeyPatch, waiting: bool
) -> None:
    """Its GPUs matter only to queued work. With none, the tenant's GPUs in use (the provider's pages)
    are published at once instead, as the cycle would have."""
    task = running(world)
    with schema_context("acme"):
        if waiting:
            tasks_submit(
                tenant=world.tenant_a,
                user=User.objects.get(username="bob"),
                requests=[TaskRequest(compute_resource="Research: 4 GPUs")],
            )
        Tenant.objects.filter(pk=world.tenant_a.pk).update(gpu_units_in_use=999)
        asked: list[str] = []
        monkeypatch.setattr(wake, "request_cycle", lambda tenant: asked.append(tenant.schema_name))
        task_finish(tenant=world.tenant_a, task=task, succeeded=True, exit_code=0, actor="agent")
        published = Tenant.objects.get(pk=world.tenant_a.pk).gpu_units_in_use
    assert asked == (["acme"] if waiting else [])
    assert published == (999 if waiting else 0)  # with work waiting, the cycle publishes it


def test_a_failed_run_retried_asks_for_a_cycle(
    world: World, db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = running(world)
    asked: list[str] = []
    monkeypatch.setattr(wake, "request_cycle", lambda tenant: asked.append(tenant.schema_name))
    with schema_context("acme"):
        task = task_finish(tenant=world.tenant_a, task=task, succeeded=False, exit_code=3, actor="agent")
    assert (task.state, asked) == (TaskState.QUEUED, ["acme"])  # it waits again itself


def test_the_lifecycle_refuses_impossible_moves(world: World, db: None) -> None:
    with schema_context("acme"):
        task = Task.objects.get(pk=world.task_a)
        with pytest.raises(InvalidInput, match="is queued; it cannot become running"):
            transition(task, to_state=TaskState.RUNNING, actor="agent")


KEYS = ("klique:cycle-lead:acme", "klique:cycle-trail:acme", "klique:cycle-cost:acme")


def test_submitting_runs_a_cycle_at_once_and_the_next_requests_share_one_after_it(
    api: Callable[..., APIClient],
    world: World,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Callable[..., AbstractContextManager[object]],
) -> None:
    sent: list[tuple[object, ...]] = []
    monkeypatch.setattr(
        celery_app, "send_task", lambda name, args, countdown: sent.append((name, *args, countdown))
    )
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(*KEYS)
    # The last cycle took 150 ms: its gap holds the next back 450 ms, longer than three requests take
    # here. (With 40 ms, a first request into a cold process, paying its imports, outlasted the gap.)
    client.set(KEYS[2], 150)
    api("bob").get("/api/v1/tasks/")  # the process warmed up, as a serving one is
    for _ in range(4):  # four requests, each its own commit
        with django_capture_on_commit_callbacks(execute=True):
            api("bob").post("/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs"}, format="json")
    assert scheduling_tasks.scheduling_cycle.name == wake.CYCLE_TASK in celery_app.tasks  # sent by its name
    # The first at once; the other three share one, after the first's foreseen run and its gap.
    assert [(name, schema) for name, schema, _ in sent] == [(wake.CYCLE_TASK, "acme")] * 2
    assert sent[0][2] == 0
    assert 0 < sent[1][2] <= 0.150 * (1 + wake.GAP_FACTOR)  # type: ignore[operator]
    # The trailing cycle's key lives no longer than its countdown: while it is there, that cycle has
    # not started, and it reads every commit that found it.
    assert 0 < client.pttl(KEYS[1]) <= sent[1][2] * 1000  # type: ignore[operator]
    client.delete(*KEYS)


@pytest.mark.parametrize("cost_ms", [5, 40, 10_000])
def test_after_a_cycle_the_next_waits_a_gap_in_proportion_to_its_cost_at_most_the_window(
    world: World,
    db: None,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Callable[..., AbstractContextManager[object]],
    cost_ms: int,
) -> None:
    from apps.scheduling.cycle import CycleResult

    window_ms = settings.KLIQUE_CYCLE_DEBOUNCE_SECONDS * 1000
    gap_ms = min(window_ms, cost_ms * wake.GAP_FACTOR)
    sent: list[float] = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, args, countdown: sent.append(countdown))
    monkeypatch.setattr(
        scheduling_tasks, "run_cycle", lambda tenant: CycleResult(ran=True, milliseconds=cost_ms)
    )
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(*KEYS)
    scheduling_tasks.scheduling_cycle.apply(args=("acme",)).get()  # beat's, say: no request made it
    assert int(client.get(KEYS[2]) or 0) == cost_ms
    assert 0 < client.pttl(KEYS[0]) <= gap_ms
    with django_capture_on_commit_callbacks(execute=True):
        wake.request_cycle(world.tenant_a)
        wake.request_cycle(world.tenant_a)  # the second finds the first's on its way
    assert len(sent) == 1
    assert 0 < sent[0] * 1000 <= gap_ms
    client.delete(KEYS[0], KEYS[1])
    with django_capture_on_commit_callbacks(execute=True):
        wake.request_cycle(world.tenant_a)  # a quiet spell: at once
    assert sent[1:] == [0]
    # The cycle it sent is foreseen to cost what the last one did: the lead holds for it and its gap.
    assert 0 < client.pttl(KEYS[0]) <= min(window_ms, cost_ms * (1 + wake.GAP_FACTOR))
    client.delete(*KEYS)


def test_without_a_window_every_request_runs_a_cycle_at_once(
    world: World,
    db: None,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Callable[..., AbstractContextManager[object]],
) -> None:
    monkeypatch.setattr(settings, "KLIQUE_CYCLE_DEBOUNCE_SECONDS", 0)
    sent: list[float] = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, args, countdown: sent.append(countdown))
    for _ in range(3):
        with django_capture_on_commit_callbacks(execute=True):
            wake.request_cycle(world.tenant_a)
    assert sent == [0, 0, 0]


def test_a_cycle_that_finds_the_lock_taken_asks_for_another(
    world: World, db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.scheduling.cycle import CycleResult

    sent: list[tuple[object, ...]] = []
    monkeypatch.setattr(scheduling_tasks, "run_cycle", lambda tenant: CycleResult(ran=False))
    monkeypatch.setattr(
        celery_app, "send_task", lambda name, args, countdown: sent.append((name, *args, countdown))
    )
    result = scheduling_tasks.scheduling_cycle.apply(args=("acme",)).get()
    assert result["ran"] is False
    assert sent == [(wake.CYCLE_TASK, "acme", settings.KLIQUE_CYCLE_DEBOUNCE_SECONDS)]


def test_the_celery_task_runs_a_cycle_in_the_schema_it_names(world: World, db: None) -> None:
    result = scheduling_tasks.scheduling_cycle.apply(args=("acme",)).get()
    assert (result["ran"], result["placed"]) == (True, 1)
    with schema_context("acme"):
        assert Task.objects.get(pk=world.task_a).state == TaskState.PLACED


def test_a_pool_coming_back_online_asks_for_a_cycle(
    world: World,
    db: None,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Callable[..., AbstractContextManager[object]],
) -> None:
    from apps.fleet.session import pool_heartbeat

    asked: list[str] = []
    monkeypatch.setattr(wake, "request_cycle", lambda tenant: asked.append(tenant.schema_name))
    with schema_context("acme"):
        pool = Pool.objects.get(name="h100")
        pool_heartbeat(tenant=world.tenant_a, pool=pool)  # already online: nothing to do
        assert asked == []
        Pool.objects.filter(pk=pool.pk).update(last_heartbeat_at=None)
        pool.refresh_from_db()
        pool_heartbeat(tenant=world.tenant_a, pool=pool)
    assert asked == ["acme"]


def test_a_pool_of_many_agents_writes_its_heartbeat_at_most_once_per_sixth_of_its_timeout(
    world: World, db: None
) -> None:
    """Each agent's heartbeat is its own row; the pool's row is written only when what it holds is older than
    a sixth of the timeout (15 s of 90), so a live pool never looks offline and a thousand agents do not
    write one row a thousand times a heartbeat."""
    from apps.fleet.session import pool_heartbeat

    with schema_context("acme"):
        pool = Pool.objects.get(name="h100")
        recent = timezone.now() - timedelta(seconds=5)
        Pool.objects.filter(pk=pool.pk).update(last_heartbeat_at=recent, heartbeat_timeout_seconds=90)
        pool.refresh_from_db()
        pool_heartbeat(tenant=world.tenant_a, pool=pool)  # another agent's heartbeat, 5 s after
        assert Pool.objects.get(pk=pool.pk).last_heartbeat_at == recent

        older = timezone.now() - timedelta(seconds=16)
        Pool.objects.filter(pk=pool.pk).update(last_heartbeat_at=older)
        pool.refresh_from_db()
        pool_heartbeat(tenant=world.tenant_a, pool=pool)
        written = Pool.objects.get(pk=pool.pk).last_heartbeat_at
        assert written is not None
        assert written > older
        assert pool.is_online(timezone.now())


@pytest.fixture
def cycles_sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The schemas of the cycles sent, each request that is made sending one (no window)."""
    monkeypatch.setattr(settings, "KLIQUE_CYCLE_DEBOUNCE_SECONDS", 0)
    sent: list[str] = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, args, countdown: sent.append(args[0]))
    return sent


def test_the_requests_of_one_transaction_ask_for_one_cycle_per_tenant(
    world: World,
    db: None,
    cycles_sent: list[str],
    django_capture_on_commit_callbacks: Callable[..., AbstractContextManager[object]],
) -> None:
    sent = cycles_sent
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        for _ in range(5):  # a burst of an agent's reports ends five runs
            wake.request_cycle(world.tenant_a)
        wake.request_cycle(world.tenant_b)
        with transaction.atomic():  # a savepoint that is kept: its request is the transaction's
            wake.request_cycle(world.tenant_b)
    assert sorted(sent) == ["acme", "globex"]


def refused_after_asking(tenant: Tenant) -> None:
    """A message that asks for a cycle and is then refused: its savepoint is rolled back."""
    with transaction.atomic():
        wake.request_cycle(tenant)
        raise RuntimeError("refused")


def test_a_request_undone_by_a_rollback_does_not_hide_the_next(
    world: World,
    db: None,
    cycles_sent: list[str],
    django_capture_on_commit_callbacks: Callable[..., AbstractContextManager[object]],
) -> None:
    sent = cycles_sent
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        with pytest.raises(RuntimeError):
            refused_after_asking(world.tenant_a)
        wake.request_cycle(world.tenant_a)  # the next message's: the first was undone with its savepoint
    assert sent == ["acme"]
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic(), pytest.raises(RuntimeError):
        refused_after_asking(world.tenant_a)
    assert sent == ["acme"]  # nothing of that transaction stands: nothing to ask
