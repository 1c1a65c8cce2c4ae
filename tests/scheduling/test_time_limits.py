"""Time limits: what a task may ask for (its profile's default, maximum and whether one is required), how
the scheduler sees them (a queued task's limit, a running one's planned end), and a run stopped at its
limit like a preemption, the task failed with its reason."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.resources.models import ComputeResource, Pool, ResourceProfile
from apps.scheduling.lifecycle import tasks_past_time_limit, transition
from apps.scheduling.models import RunOutcome, Task, TaskRun, TaskState
from apps.scheduling.reads import snapshot
from apps.scheduling.runs import run_begin
from tests.scheduling.config import acme_document
from tests.world import World

RESOURCE = "Research: 4 GPUs"


def profile_of(resource: str = RESOURCE) -> ResourceProfile:
    return ComputeResource.objects.get(name=resource).profile


def limits(**fields: Any) -> None:
    with schema_context("acme"):
        ResourceProfile.objects.filter(pk=profile_of().pk).update(**fields)


def submit(api: Callable[..., APIClient], **body: Any) -> Any:
    return api("bob").post("/api/v1/tasks/", {"compute_resource": RESOURCE, **body}, format="json")


def test_a_task_gets_the_limit_it_asks_for_or_its_profile_s_default(
    api: Callable[..., APIClient], world: World
) -> None:
    assert submit(api).json()["time_limit_seconds"] is None  # no default, none asked: no limit
    assert submit(api, time_limit_seconds=7200).json()["time_limit_seconds"] == 7200
    limits(time_limit_default_seconds=3600, time_limit_max_seconds=4 * 3600)
    assert submit(api).json()["time_limit_seconds"] == 3600
    assert submit(api, time_limit_seconds=4 * 3600).json()["time_limit_seconds"] == 4 * 3600


@pytest.mark.parametrize(
    ("profile", "body", "fragment"),
    [
        (
            {"time_limit_max_seconds": 3600},
            {"time_limit_seconds": 3601},
            "allows a time limit of at most 1 h",
        ),
        ({}, {"time_limit_seconds": 59}, "at least 60"),
        ({}, {"time_limit_seconds": 0}, "at least 60"),
        ({}, {"time_limit_seconds": -5}, "at least 60"),
        ({}, {"time_limit_seconds": 31 * 86_400}, "at most 720 h"),
        ({"time_limit_required": True}, {}, "needs a time limit: give time_limit_seconds"),
        ({"time_limit_required": True, "time_limit_max_seconds": 600}, {}, "at most 10 min"),
        ({}, {"time_limit_seconds": "two hours"}, "valid integer"),
        ({}, {"time_limit_seconds": 1.5}, "valid integer"),
    ],
)
def test_a_limit_outside_the_profile_s_bounds_is_refused_saying_which(
    api: Callable[..., APIClient], world: World, profile: dict[str, Any], body: dict[str, Any], fragment: str
) -> None:
    limits(**profile)
    answer = submit(api, **body)
    assert answer.status_code == 400, answer.content
    assert fragment in str(answer.json()), answer.json()
    assert "time_limit_seconds" in str(answer.json()["errors"])


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        (
            {"time_limit_default_seconds": 7200, "time_limit_max_seconds": 3600},
            "is above time_limit_max_seconds",
        ),
        ({"time_limit_max_seconds": 30}, "greater than or equal to 60"),
        ({"time_limit_default_seconds": 40 * 86_400}, "less than or equal to 2592000"),
    ],
)
def test_a_profile_s_limits_that_cannot_work_are_refused_in_the_draft(
    api: Callable[..., APIClient], world: World, changes: dict[str, int], fragment: str
) -> None:
    document = acme_document()
    document["profiles"][0].update(changes)
    answer = api("alice").put("/api/v1/configuration/draft/", {"document": document}, format="json")
    assert answer.status_code == 400, answer.content
    assert fragment in str(answer.json())


def test_a_profile_s_limits_round_trip_through_the_configuration(
    api: Callable[..., APIClient], world: World
) -> None:
    document = acme_document()
    document["profiles"][0].update(
        {"time_limit_default_seconds": 3600, "time_limit_max_seconds": 86_400, "time_limit_required": True}
    )
    client = api("alice")
    assert (
        client.put("/api/v1/configuration/draft/", {"document": document}, format="json").status_code == 200
    )
    provisioned = client.post("/api/v1/configuration/draft/provision/")
    assert provisioned.status_code == 200, provisioned.content
    shown = client.get("/api/v1/configuration/").json()["profiles"]
    first = next(item for item in shown if item["name"] == document["profiles"][0]["name"])
    assert (
        first["time_limit_default_seconds"],
        first["time_limit_max_seconds"],
        first["time_limit_required"],
    ) == (
        3600,
        86_400,
        True,
    )


def running_task(world: World, *, limit: int | None, started_ago: timedelta) -> Task:
    with schema_context("acme"):
        task = Task.objects.get(pk=world.task_a)
        Task.objects.filter(pk=task.pk).update(time_limit_seconds=limit)
        task.refresh_from_db()
        h100 = Pool.objects.get(name="h100")
        transition(task, to_state=TaskState.PLACED, actor="scheduler", pool=h100)
        lease = uuid.uuid4()
        run_begin(task, lease=lease, pool=h100, agent_id="rack-1", now=timezone.now())
        Task.objects.filter(pk=task.pk).update(lease_id=lease)
        task.refresh_from_db()
        transition(task, to_state=TaskState.DISPATCHING, actor="agent")
        transition(task, to_state=TaskState.RUNNING, actor="agent", attempts=1)
        Task.objects.filter(pk=task.pk).update(started_at=timezone.now() - started_ago)
        task.refresh_from_db()
        return task


def test_a_run_past_its_time_limit_is_stopped_with_its_grace_period_and_the_task_fails_saying_why(
    world: World, db: None
) -> None:
    task = running_task(world, limit=3600, started_ago=timedelta(hours=1, seconds=5))
    with schema_context("acme"):
        assert tasks_past_time_limit(tenant=world.tenant_a) == 1
        task.refresh_from_db()
        assert task.state == TaskState.FAILED
        assert task.reason_code == "time_limit"
        assert task.reason.startswith("Stopped at its time limit of 1 h, with 30 s to checkpoint first")
        run = TaskRun.objects.filter(task=task).latest("attempt")
        assert (run.outcome, run.stop, run.stop_grace_seconds) == (RunOutcome.STOPPED, "preempt", 30.0)
        assert tasks_past_time_limit(tenant=world.tenant_a) == 0  # once


@pytest.mark.parametrize(("limit", "ago"), [(3600, timedelta(minutes=59)), (None, timedelta(days=40))])
def test_a_run_within_its_limit_or_without_one_runs_on(
    world: World, db: None, limit: int | None, ago: timedelta
) -> None:
    task = running_task(world, limit=limit, started_ago=ago)
    with schema_context("acme"):
        assert tasks_past_time_limit(tenant=world.tenant_a) == 0
        task.refresh_from_db()
        assert task.state == TaskState.RUNNING


def test_the_scheduler_sees_a_queued_task_s_limit_and_a_running_one_s_planned_end(
    api: Callable[..., APIClient], world: World
) -> None:
    queued = submit(api, time_limit_seconds=1800).json()["id"]
    task = running_task(world, limit=3600, started_ago=timedelta(minutes=10))
    with schema_context("acme"):
        now = timezone.now()
        seen, _shown = snapshot(world.tenant_a, now)
    assert next(item for item in seen.queued if item.id == queued).time_limit == 1800
    allocation = next(item for item in seen.running if item.task == str(task.pk))
    assert allocation.ends_at == pytest.approx((now - timedelta(minutes=10)).timestamp() + 3600, abs=2)
