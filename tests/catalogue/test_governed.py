"""Apps are governed like any task: they count against their group's limit, they are preempted where their
group borrowed what another group reserved, and their GPU time goes to the ledger."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.catalogue import selectors
from apps.catalogue.models import AppInstance
from apps.metering.models import LedgerEvent
from apps.resources.models import Pool
from apps.scheduling.cycle import run_cycle
from apps.scheduling.models import Task, TaskState
from apps.scheduling.services import TaskRequest, tasks_submit
from tests.catalogue.conftest import launch
from tests.world import World

pytestmark = pytest.mark.django_db


def test_apps_count_against_limits_are_preempted_and_metered_like_tasks(world: World) -> None:
    tenant = world.tenant_a
    with schema_context(tenant.schema_name):
        Task.objects.all().delete()
    apps = [launch(world, "carol", name=f"dev-{index}", compute_resource="Dev: 4 GPUs") for index in range(5)]
    with schema_context(tenant.schema_name):
        run_cycle(tenant)
        tasks = {app.pk: Task.objects.get(pk=str(app.task_id)) for app in apps}
        placed = [app for app in apps if tasks[app.pk].state == TaskState.PLACED]
        (waiting,) = [app for app in apps if tasks[app.pk].state == TaskState.QUEUED]
        assert len(placed) == 4  # Dev's limit: 16 GPUs, all of them borrowed beyond its reservation of 8
        assert "limit" in tasks[waiting.pk].reason
        # Their agents run them, each started some minutes ago.
        pools = list(Pool.objects.order_by("name"))
        for minutes, app in zip((40, 10, 30, 20), placed, strict=True):
            started = timezone.now() - timedelta(minutes=minutes)
            task = tasks[app.pk]
            Task.objects.filter(pk=task.pk).update(
                state=TaskState.RUNNING, submitted_at=started, queued_at=started, placed_at=started,
                started_at=started, pool=task.pool or pools[0],
            )  # fmt: skip
        # Research asks for what it reserved: Dev's most recently started borrowing run goes back.
        bob = User.objects.get(username="bob")
        tasks_submit(tenant=tenant, user=bob, requests=[TaskRequest(compute_resource="Research: 4 GPUs")])
        result = run_cycle(tenant)
        assert result.preempted == 1
        (victim,) = [
            app for app in placed if Task.objects.get(pk=str(app.task_id)).reason_code == "preempted"
        ]
        task = Task.objects.get(pk=str(victim.task_id))
        assert task.state == TaskState.QUEUED  # back in its queue, to run again when there is room
        state = selectors.app_state(AppInstance.objects.select_related("task").get(pk=victim.pk))
        assert state.state == selectors.STARTING
        # The preempted run went to the ledger, and the app's GPU time shows it.
        (segment,) = LedgerEvent.objects.filter(event_id__startswith=f"gpu:{task.pk}:")
        assert (segment.username, segment.group_name) == ("carol", "dev")
        assert selectors.app_usage(victim)["gpu_hours"] > 0
