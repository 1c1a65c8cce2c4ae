"""One wallet for GPU-hours and tokens: a project's budget in USD pays for its GPU runs and its gateway
calls; when it is spent, new tasks wait with that reason (and the gateway refuses its calls)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import Project, User
from apps.metering.models import PriceBook
from apps.metering.runs import run_segment
from apps.resources.models import Pool
from apps.scheduling.cycle import run_cycle
from apps.scheduling.models import Task, TaskState
from apps.scheduling.services import TaskRequest, tasks_submit
from gateway.budgets import budget_key
from gateway.cache import sync_redis
from gateway.models import Budget
from gateway.services import budget_create, budget_top_up
from gateway.wallets import enforced, ledger_spent, spent_budgets
from tests.world import World

pytestmark = pytest.mark.django_db


def gpu_run(*, hours: int, gpus: int, project: str = "apollo") -> None:
    """A run's segment as the lifecycle meters it: its submitter, project and pool by id."""
    ended = timezone.now()
    run_segment(
        task_id=f"elsewhere-{hours}-{gpus}-{project}",
        started_at=ended - timedelta(hours=hours),
        ended_at=ended,
        user_id=str(User.objects.get(username="bob").pk),
        project_id=str(Project.objects.get(name=project).pk),
        group="research",
        pool_id=str(Pool.objects.get(name="h100").pk),
        compute_resource="Research: 4 GPUs",
        units=gpus * 840,
    )


@pytest.fixture
def priced(world: World) -> World:
    with schema_context("acme"):
        PriceBook.objects.update_or_create(pk=1, defaults={"gpu_hour": {"H100": "2.50"}})
    return world


def test_a_spent_project_wallet_holds_its_new_tasks_with_the_reason(priced: World) -> None:
    with schema_context("acme"):
        bob = User.objects.get(username="bob")
        wallet = budget_create(scope="project", project="apollo", unit="usd", limit="1", period="none")
        (task,) = tasks_submit(
            tenant=priced.tenant_a,
            user=bob,
            requests=[TaskRequest(compute_resource="Research: 4 GPUs", project="apollo", name="costly")],
        )
        gpu_run(hours=1, gpus=4)  # 4 GPU-hours at 2.50: 10 USD, from a wallet of 1
        assert ledger_spent(enforced(wallet), now=timezone.now()) == 10 * 10**9
        assert spent_budgets(now=timezone.now()).projects == {
            str(wallet.project_id): "No room left in project apollo's wallet: 10 USD of 1 USD spent. "
            "Ask a tenant admin to raise it or top it up."
        }
        run_cycle(priced.tenant_a)
        task.refresh_from_db()
        assert (task.state, task.reason_code) == (TaskState.QUEUED, "budget_exhausted")
        assert task.reason.startswith("Waiting for budget: No room left in project apollo's wallet")
        # Work outside the project is not held: the world's own task (no project) was placed.
        assert Task.objects.get(pk=priced.task_a).state == TaskState.PLACED

        budget_top_up(budget=wallet, amount=20)
        run_cycle(priced.tenant_a)
        task.refresh_from_db()
        assert task.state == TaskState.PLACED


def test_gpu_cost_reaches_the_gateways_live_counters(
    priced: World, django_capture_on_commit_callbacks: Any
) -> None:
    with schema_context("acme"):
        wallet = budget_create(scope="project", project="apollo", unit="usd", limit="100", period="month")
        key = budget_key("acme", enforced(wallet), timezone.now())
        sync_redis().delete(key)
        sync_redis().hset(key, mapping={"spent": 5, "reserved": 0})  # the gateway has started it
        try:
            with django_capture_on_commit_callbacks(execute=True):
                gpu_run(hours=2, gpus=1)  # 2 GPU-hours at 2.50
            assert int(sync_redis().hget(key, "spent")) == 5 + 5 * 10**9
        finally:
            sync_redis().delete(key)
        assert Budget.objects.get(pk=wallet.pk).limit == Decimal(100)


@pytest.mark.parametrize(
    ("spent", "held"),
    [
        ({"users": ["bob"]}, {"bob-apollo", "bob-alone", "world"}),  # the world's own task is bob's
        ({"projects": ["apollo"]}, {"bob-apollo", "alice-apollo"}),
        ({"users": ["alice"], "projects": ["apollo"]}, {"bob-apollo", "alice-apollo", "alice-alone"}),
        ({"tenant": True}, {"bob-apollo", "bob-alone", "alice-apollo", "alice-alone", "world"}),
    ],
)
def test_a_spent_budget_holds_the_queued_tasks_that_draw_from_it_and_no_others(
    world: World, monkeypatch: pytest.MonkeyPatch, spent: dict[str, Any], held: set[str]
) -> None:
    """The cycle reads only the queued tasks of the users and projects whose budget is spent (all of them
    for the tenant's): each of those, and only those, is held with its budget's sentence."""
    from apps.scheduling import cycle
    from gateway.wallets import Blocked

    with schema_context("acme"):
        names = {}
        for user in ("bob", "alice"):
            for project in ("apollo", None):
                (task,) = tasks_submit(
                    tenant=world.tenant_a,
                    user=User.objects.get(username=user),
                    requests=[TaskRequest(compute_resource="Research: 4 GPUs", project=project)],
                )
                names[str(task.pk)] = f"{user}-{project or 'alone'}"
        names[world.task_a] = "world"
        users = {str(User.objects.get(username=name).pk): f"{name}'s" for name in spent.get("users", [])}
        projects = {str(Project.objects.get(name=name).pk): name for name in spent.get("projects", [])}
        blocked = Blocked("the tenant's" if spent.get("tenant") else None, projects, users)
        monkeypatch.setattr(cycle, "spent_budgets", lambda now: blocked)
        with CaptureQueriesContext(connection) as read:
            found = cycle._held_by_budgets(timezone.now())
    assert {names[task] for task in found} == held
    (query,) = [query["sql"] for query in read.captured_queries if "scheduling_task" in query["sql"]]
    assert (" IN (" in query) == (not spent.get("tenant"))  # not the whole queue, unless the tenant's
    assert all(reason.startswith("Waiting for budget: ") for reason in found.values())
