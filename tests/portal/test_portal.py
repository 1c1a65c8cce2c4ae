"""The tenant portal in real Chromium: sign in, submit a task and see it listed without a reload, watch
its output stream live, the dashboard's chart drawn with data; labels on every control, no console
errors. Screenshots of each page go to test-artifacts/portal/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.portal.conftest import PASSWORD, Portal, screenshot, sign_in, wait_for

pytestmark = pytest.mark.django_db

UNLABELLED = """() => [...document.querySelectorAll('input:not([type=hidden]), select, textarea')]
    .filter((control) => control.labels.length === 0).map((control) => control.name)"""


def test_signing_in_with_a_wrong_password_says_so(page: Any, portal: Portal) -> None:
    page.goto(f"{portal.base}/portal/")
    assert "/portal/sign-in/" in page.url
    assert page.evaluate(UNLABELLED) == []
    screenshot(page, "sign-in")
    page.get_by_label("Username").fill("pat")
    page.get_by_label("Password").fill("wrong")
    page.get_by_role("button", name="Sign in").click()
    assert page.get_by_role("alert").inner_text() == "Wrong username or password, or not a break-glass admin."
    assert PASSWORD not in page.content()


def test_a_submitted_task_appears_without_a_reload_and_its_output_streams_live(
    page: Any, portal: Portal
) -> None:
    from apps.fleet.dispatch import task_report
    from apps.scheduling.models import Task
    from tenants.models import Tenant

    sign_in(page, portal)
    assert page.evaluate(UNLABELLED) == []
    page.evaluate("window.notReloaded = true")
    page.get_by_label("Compute resource", exact=True).select_option("Research: 4 GPUs")
    page.get_by_label("Name", exact=True).fill("portal-run")
    page.get_by_label("Command", exact=True).fill("python train.py --epochs 3")
    page.get_by_role("button", name="Submit").click()
    page.get_by_role("status").filter(has_text="Task portal-run is queued.").wait_for()
    assert page.get_by_role("link", name="portal-run").is_visible()
    assert page.locator("tr[data-task='portal-run'] .position").inner_text() == "1"  # first in its queue
    assert page.evaluate("window.notReloaded") is True  # the table came back in place
    screenshot(page, "tasks")

    task_id = portal.run(lambda: str(Task.objects.get(name="portal-run").pk))
    page.get_by_role("link", name="portal-run").click()
    page.wait_for_url(re.compile(rf".*/portal/tasks/{task_id}/"))
    wait_for(page, "document.querySelector('#log-state').textContent.length > 0")

    def report(seq: int, lines: list[str]) -> None:
        def send() -> None:
            task = Task.objects.get(pk=task_id)
            tenant = Tenant.objects.get(schema_name="portal")
            task_report(tenant=tenant, task=task, source="node-0", seq=seq, kind="log", body={"lines": lines})

        portal.run(send)

    page.wait_for_timeout(500)  # the page's websocket is subscribed
    report(1, ["epoch 1/3 loss=1.000"])
    page.get_by_text("epoch 1/3 loss=1.000").wait_for()
    report(2, ["epoch 2/3 loss=0.500", "epoch 3/3 loss=0.333"])
    page.get_by_text("epoch 3/3 loss=0.333").wait_for()
    assert page.locator("#log").inner_text().splitlines() == [
        "epoch 1/3 loss=1.000",
        "epoch 2/3 loss=0.500",
        "epoch 3/3 loss=0.333",
    ]
    screenshot(page, "task-log")

    def place() -> None:
        from apps.resources.models import Pool
        from apps.scheduling.lifecycle import transition

        task = Task.objects.get(pk=task_id)
        transition(task, to_state="placed", actor="scheduler", pool=Pool.objects.get(name="baremetal"))

    portal.run(place)  # its state and pool change on the open page
    page.locator("#state").filter(has_text="placed").wait_for()
    assert "baremetal" in page.locator("#facts").inner_text()

    def keep_output() -> None:
        from django.core.files.base import ContentFile
        from django.core.files.storage import default_storage

        from apps.fleet.models import TaskOutput

        stored = default_storage.save(f"portal/{task_id}/metrics.json", ContentFile(b'{"loss": 0.333}'))
        TaskOutput.objects.create(
            task_id=task_id, name="metrics.json", size=15, sha256="0" * 64, stored=stored
        )

    portal.run(keep_output)
    page.reload()
    with page.expect_download() as download:
        page.get_by_role("link", name="metrics.json").click()
    assert Path(download.value.path()).read_bytes() == b'{"loss": 0.333}'
    assert portal.errors == []


def seed_a_busy_hour() -> str:
    """A task running on h100 whose GPU samples average 25%, and 4 GPU-hours metered in the last hour."""
    from datetime import timedelta

    from django.utils import timezone

    from apps.accounts.models import User
    from apps.fleet.models import TaskReport
    from apps.metering.ledger import Event, ingest
    from apps.resources.models import ComputeResource, Pool
    from apps.scheduling.models import Task, TaskEvent, TaskState

    now = timezone.now()
    pat = User.objects.get(username="pat")
    resource = ComputeResource.objects.get(name="Research: 4 GPUs")
    task = Task.objects.create(
        name="idle-run",
        compute_resource=resource,
        compute_resource_name=resource.name,
        submitter=pat,
        size_units=4 * 840,
        state=TaskState.RUNNING,
        pool=Pool.objects.get(name="h100"),
        submitted_at=now - timedelta(minutes=40),
        queued_at=now - timedelta(minutes=40),
        placed_at=now - timedelta(minutes=40),
        started_at=now - timedelta(minutes=30),
    )
    TaskEvent.objects.create(
        task=task, at=now - timedelta(minutes=30), actor="agent", from_state="dispatching", to_state="running"
    )
    for seq, percent in enumerate((30.0, 20.0), 1):
        gpus = [
            {"index": 0, "utilization_percent": percent, "memory_used_mib": 1.0, "memory_total_mib": 80.0}
        ]
        TaskReport.objects.create(
            task=task, source="node-0", seq=seq, kind="metric", body={"values": {"gpus": gpus}}
        )
    ended = now - timedelta(minutes=1)
    metered = Event(
        event_id=f"dashboard-{task.pk}",
        kind="gpu",
        started_at=ended - timedelta(hours=1),
        ended_at=ended,
        user="pat",
        pool="h100",
        gpus=4,
    )
    ingest([metered])
    return str(task.pk)


def test_the_dashboard_draws_its_charts_with_data(page: Any, portal: Portal) -> None:
    idle_task = portal.run(seed_a_busy_hour)
    sign_in(page, portal)
    page.get_by_role("link", name="Dashboard").click()
    wait_for(page, "document.getElementById('gpu-chart').chart !== undefined")
    labels = page.evaluate("document.getElementById('gpu-chart').chart.data.labels")
    assert labels == ["baremetal", "h100"]
    capacity = page.evaluate(
        "(() => { const c = document.getElementById('gpu-chart').chart;"
        " return c.data.datasets[0].data.map((used, i) => used + c.data.datasets[1].data[i]); })()"
    )
    assert capacity == [8, 8]
    painted = page.evaluate(
        "(() => { const c = document.getElementById('gpu-chart');"
        " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        " for (let i = 3; i < d.length; i += 4) if (d[i] > 0) return true; return false; })()"
    )
    assert painted
    percent = page.evaluate("document.getElementById('utilization-chart').chart.data.datasets[0].data")
    assert len(percent) == 24
    assert max(percent) == 25.0  # 4 GPU-hours in one hour of 16 GPUs
    page.get_by_label("Over the last", exact=True).select_option("7d")  # per day now, in place
    wait_for(page, "document.getElementById('utilization-chart').chart.data.labels.length === 7")
    daily = page.evaluate("document.getElementById('utilization-chart').chart.data.datasets[0].data")
    assert max(daily) == 1.0  # the same 4 GPU-hours in a day of 16 GPUs: 1.04%
    page.get_by_label("Over the last", exact=True).select_option("24h")
    idle = page.locator(f"tr[data-idle='{idle_task}']")
    assert idle.locator("td").all_inner_texts()[1:] == ["h100", "pat", "25.0%"]
    assert "idle-run: dispatching → running (agent)" in page.locator("#events").inner_text()

    def research_gpus() -> str:
        from apps.scheduling.models import ACTIVE_STATES, Task

        held = Task.objects.filter(state__in=ACTIVE_STATES, compute_resource__policy__group__name="research")
        return str(round(sum(held.values_list("size_units", flat=True)) / 840, 3))  # 4 of them idle-run's

    assert page.locator("tr[data-group='research'] td").nth(1).inner_text() == portal.run(research_gpus)
    screenshot(page, "dashboard")
    assert portal.errors == []


def test_keyboard_reaches_every_control_of_the_submit_form(page: Any, portal: Portal) -> None:
    sign_in(page, portal)
    reached = set()
    for _ in range(20):
        page.keyboard.press("Tab")
        reached.add(page.evaluate("document.activeElement.id || document.activeElement.textContent.trim()"))
    assert {"compute_resource", "gpus", "name", "command", "Submit"} <= reached


def test_a_policy_changes_through_validate_and_provision(page: Any, portal: Portal) -> None:
    import json

    sign_in(page, portal)
    page.get_by_role("link", name="Configuration").click()
    assert page.evaluate(UNLABELLED) == []
    draft = page.get_by_label("Draft configuration (JSON)")
    document = json.loads(draft.input_value())
    research = next(policy for policy in document["policies"] if policy["name"] == "research")
    assert research["limit_gpus"] == "16"

    draft.fill("{ not json")
    page.get_by_role("button", name="Save and validate").click()
    assert page.get_by_role("alert").inner_text().startswith("The draft is not JSON:")

    research["limit_gpus"] = "12"
    draft.fill(json.dumps(document, indent=2))
    page.get_by_role("button", name="Save and validate").click()
    page.get_by_role("status").filter(has_text="Valid: the draft can be provisioned.").wait_for()
    screenshot(page, "configuration-validated")
    page.get_by_role("button", name="Provision").click()
    page.get_by_role("status").filter(has_text="Provisioned:").wait_for()
    row = page.get_by_role("row").filter(has_text="research")
    assert row.locator(".limit").inner_text() == "12 GPUs"  # the policies in force, updated in place
    screenshot(page, "configuration-provisioned")
    assert portal.errors == []

    from apps.resources.models import ResourcePolicy

    assert portal.run(lambda: ResourcePolicy.objects.get(name="research").limit_units) == 12 * 840


def test_the_dashboard_shows_cpus_and_workers_per_environment_and_follows_the_cluster_live(
    page: Any, portal: Portal
) -> None:
    """Agents' reported CPUs and nodes per environment; a cycle that places a task and a heartbeat with
    new CPU figures reach the open page's tables and chart without a reload."""
    from apps.accounts.models import User
    from apps.fleet.models import Agent, AgentToken
    from apps.fleet.session import agent_heartbeat
    from apps.resources.models import Pool
    from apps.scheduling.cycle import run_cycle
    from apps.scheduling.models import ACTIVE_STATES, Task
    from apps.scheduling.services import TaskRequest, tasks_submit
    from protocol.messages import Heartbeat
    from tenants.models import Tenant

    def connect() -> None:
        baremetal = Pool.objects.get(name="baremetal")
        Agent.objects.create(
            id="bm-host-1",
            pool=baremetal,
            backend="baremetal",
            connected=True,
            cpus=64,
            cpus_in_use=16,
            nodes=1,
        )
        Agent.objects.create(
            id="k8s-1",
            pool=Pool.objects.get(name="h100"),
            backend="kubernetes",
            connected=True,
            gpus=[
                {
                    "class": "NVIDIA-H100-80GB-HBM3",
                    "resource": "nvidia.com/gpu",
                    "allocatable": 8,
                    "allocated": 2,
                }
            ],
            problem="the agent's service account may not create jobs in namespace ml: apply the chart's Role",
        )

    portal.run(connect)
    sign_in(page, portal)
    page.get_by_role("link", name="Dashboard").click()
    wait_for(page, "document.getElementById('gpu-chart').chart !== undefined")
    cells = page.locator("tr[data-environment='baremetal'] td").all_inner_texts()
    assert cells == ["baremetal", "1", "8", cells[3], cells[4], "16 of 64", "1", "1"]
    kubernetes = page.locator("tr[data-environment='kubernetes'] td").all_inner_texts()
    assert kubernetes[5:] == ["not reported", "1", "-"]  # an agent that reports no CPUs is not a guess
    assert page.locator("tr[data-class='A100'] td").nth(1).inner_text() == "8"
    said = page.locator("tr[data-pool='h100'] td.cluster").inner_text()
    assert "NVIDIA-H100-80GB-HBM3 nvidia.com/gpu: 2 of 8 allocated" in said
    assert "k8s-1: the agent's service account may not create jobs in namespace ml" in said
    page.evaluate("window.notReloaded = true")
    before = page.evaluate("document.getElementById('gpu-chart').chart.data.datasets[0].data")

    def place_a_task() -> list[float]:
        tenant = Tenant.objects.get(schema_name="portal")
        token = AgentToken.objects.create(pool=Pool.objects.get(name="baremetal"), name="bm", prefix="bmlive")
        agent_heartbeat(
            tenant=tenant,
            token=token,
            agent_id="bm-host-1",
            heartbeat=Heartbeat(capacity={"cpus": 64, "cpus_in_use": 40, "nodes": 1}),
        )
        pat = User.objects.get(username="pat")
        tasks_submit(
            tenant=tenant, user=pat, requests=[TaskRequest(compute_resource="Dev: 4 GPUs", name="live")]
        )
        assert run_cycle(tenant).placed >= 1
        held = {pool.name: 0.0 for pool in Pool.objects.order_by("environment", "name")}
        for name, size in Task.objects.filter(state__in=ACTIVE_STATES, pool__isnull=False).values_list(
            "pool__name", "size_units"
        ):
            held[name] += size / 840
        return list(held.values())

    expected = portal.run(place_a_task)
    assert expected != before
    wait_for(
        page,
        "(expected) => JSON.stringify(document.getElementById('gpu-chart').chart.data.datasets[0].data)"
        " === JSON.stringify(expected)",
        arg=expected,
    )
    page.locator("tr[data-environment='baremetal'] .cpus").filter(has_text="40 of 64").wait_for()
    assert page.evaluate("window.notReloaded") is True
    screenshot(page, "dashboard-live")
    assert portal.errors == []
