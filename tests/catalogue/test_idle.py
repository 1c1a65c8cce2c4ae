"""An app nobody reached through its route for its idle timeout is stopped, and not a moment before; its
owner reads why, and the stop is Klique's, not theirs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.catalogue import selectors, services
from apps.catalogue.models import AppInstance
from apps.fleet.models import TaskReport
from apps.scheduling.models import Task, TaskEvent, TaskState
from tests.catalogue.conftest import launch
from tests.world import World

pytestmark = pytest.mark.django_db


def running(app: AppInstance, *, last_request: timedelta) -> None:
    now = timezone.now()
    Task.objects.filter(pk=str(app.task_id)).update(state=TaskState.RUNNING)
    AppInstance.objects.filter(pk=app.pk).update(
        tunnel_channel="t", ready_at=now - timedelta(hours=1), last_request_at=now - last_request
    )


def test_an_idle_app_is_stopped_after_its_timeout_and_not_before(world: World) -> None:
    busy, idle = launch(world, name="busy"), launch(world, name="idle")
    tenant = world.tenant_a
    with schema_context(tenant.schema_name):
        running(busy, last_request=timedelta(seconds=590))
        running(idle, last_request=timedelta(seconds=610))
        assert selectors.app_state(AppInstance.objects.get(pk=busy.pk)).state == selectors.IDLE
        stopped = services.apps_reclaim_idle(tenant=tenant)
        assert [app.pk for app in stopped] == [idle.pk]
        assert services.apps_reclaim_idle(tenant=tenant) == []  # once
        assert Task.objects.get(pk=str(busy.task_id)).state == TaskState.RUNNING
        task = Task.objects.get(pk=str(idle.task_id))
        assert task.state == TaskState.ABORTED
        assert task.reason.startswith("Stopped after 10 minute(s) without a request (its idle timeout)")
        assert TaskEvent.objects.filter(task=task, to_state=TaskState.ABORTED).get().actor == "klique"
        state = selectors.app_state(AppInstance.objects.select_related("task").get(pk=idle.pk))
        assert state.state == selectors.STOPPED
        assert "its files stay" in state.detail
        # Ten minutes on, the busy one is idle too.
        later = services.apps_reclaim_idle(tenant=tenant, now=timezone.now() + timedelta(seconds=20))
        assert [app.pk for app in later] == [busy.pk]


def test_an_app_without_an_idle_timeout_runs_on(world: World) -> None:
    app = launch(world)
    with schema_context(world.tenant_a.schema_name):
        AppInstance.objects.filter(pk=app.pk).update(template={**app.template, "idle_timeout_seconds": None})
        running(app, last_request=timedelta(days=3))
        assert services.apps_reclaim_idle(tenant=world.tenant_a) == []


def gpu_samples(app: AppInstance, percent: float, minutes_ago: int) -> None:
    TaskReport.objects.create(
        task_id=str(app.task_id),
        source="agent",
        seq=minutes_ago,
        kind="metric",
        body={"values": {"gpus": [{"utilization_percent": percent}]}},
        at=timezone.now() - timedelta(minutes=minutes_ago),
    )


def test_an_app_whose_gpus_work_is_not_idle_without_requests(world: World) -> None:
    training, waiting, unsampled = (launch(world, name=name) for name in ("training", "waiting", "unsampled"))
    tenant = world.tenant_a
    with schema_context(tenant.schema_name):
        for app in (training, waiting, unsampled):
            running(app, last_request=timedelta(hours=2))
        for minutes in (1, 5, 9):
            gpu_samples(training, 60.0, minutes)
            gpu_samples(waiting, 1.0, minutes)
        gpu_samples(training, 0.0, 30)  # before its idle timeout's window: not counted
        stopped = services.apps_reclaim_idle(tenant=tenant)
        assert {app.name for app in stopped} == {"waiting", "unsampled"}
        reason = Task.objects.get(pk=str(waiting.task_id)).reason
        assert "without a request and its GPUs averaged 1% (its idle timeout)" in reason
        assert Task.objects.get(pk=str(training.task_id)).state == TaskState.RUNNING
