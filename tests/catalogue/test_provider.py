"""The provider's center counts each tenant's apps, running and all, across their schemas in one query; the
portal reads the GPU time of a page of apps in two queries."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django_tenants.utils import schema_context

from apps.catalogue.selectors import apps_by_tenant
from apps.scheduling.models import Task, TaskState
from tenants.models import Tenant
from tests.catalogue.conftest import launch
from tests.world import World

pytestmark = pytest.mark.django_db


def test_each_tenants_apps_are_counted_running_and_all(world: World) -> None:
    running, _, stopped = (launch(world, name=name) for name in ("one", "two", "three"))
    with schema_context(world.tenant_a.schema_name):
        Task.objects.filter(pk=str(running.task_id)).update(state=TaskState.RUNNING)
        Task.objects.filter(pk=str(stopped.task_id)).update(state=TaskState.ABORTED)
    counted = apps_by_tenant(list(Tenant.objects.order_by("slug")))
    assert counted[world.tenant_a.slug] == (1, 3)
    assert counted[world.tenant_b.slug] == (0, 0)
    assert "public" not in counted
    assert apps_by_tenant([]) == {}


def test_the_apps_gpu_time_is_read_for_a_whole_page_in_three_queries(
    world: World, django_assert_max_num_queries: Any
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from apps.catalogue.selectors import apps_usage
    from apps.metering.runs import run_segment
    from apps.resources.models import Pool
    from protocol.units import UNITS_PER_GPU

    apps = [launch(world, name=f"app-{index}") for index in range(5)]
    with schema_context(world.tenant_a.schema_name):
        now = timezone.now()
        finished, running = apps[0], apps[1]
        task = Task.objects.get(pk=str(finished.task_id))
        pool = str(Pool.objects.values_list("pk", flat=True).first())
        Task.objects.filter(pk=task.pk).update(submitted_at=now - timedelta(hours=3))
        task.refresh_from_db()
        for hour in range(2):  # two metered hours of its 4 GPUs
            start = task.submitted_at + timedelta(hours=hour)
            report = run_segment(
                task_id=str(task.pk), started_at=start, ended_at=start + timedelta(hours=1),
                user_id=str(task.submitter_id), project_id="", group="", pool_id=pool,
                compute_resource=task.compute_resource_name, units=4 * UNITS_PER_GPU,
            )  # fmt: skip
            assert report.accepted == 1, report
        Task.objects.filter(pk=str(running.task_id)).update(
            state=TaskState.RUNNING, started_at=now - timedelta(minutes=30), metered_until=None
        )
        with django_assert_max_num_queries(3):  # the apps' tasks, their workers', the ledger's sums
            usage = apps_usage(apps, now)
    assert usage[finished.pk]["gpu_hours"] == Decimal("8")
    assert usage[running.pk]["gpu_hours"] == Decimal("2")  # half an hour of 4 GPUs, not metered yet
    assert {usage[app.pk]["gpu_hours"] for app in apps[2:]} == {Decimal(0)}
    assert set(usage) == {app.pk for app in apps}
