"""What a newcomer meets first: pages that cannot be framed and run only Klique's own scripts, a demo
without Django's debug pages, and an output upload that the web process streams to disk instead of holding
in memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.test import Client
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.fleet.models import TaskOutput
from apps.resources.models import Pool
from apps.scheduling.models import Task, TaskRun, TaskState
from tests.security.conftest import memory_mb
from tests.world import HOST_A, HOST_PROVIDER, World

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("host", [HOST_A, HOST_PROVIDER])
def test_portal_pages_carry_a_content_security_policy_and_cannot_be_framed(host: str, world: World) -> None:
    answer = Client(HTTP_HOST=host).get("/portal/sign-in/")
    assert answer.status_code == 200
    policy = answer.headers["Content-Security-Policy"]
    for directive in (
        "default-src 'self'",
        "script-src 'self'",
        "frame-ancestors 'none'",
        "object-src 'none'",
    ):
        assert directive in policy
    parts = dict(part.strip().split(" ", 1) for part in policy.split(";"))
    assert "unsafe" not in parts["script-src"]  # no inline script, no eval
    assert "unsafe" not in parts["style-src-elem"]  # no <style> but Klique's own sheets
    assert "unsafe-eval" not in policy
    assert answer.headers["X-Frame-Options"] == "DENY"


def test_api_answers_cannot_be_framed_either(world: World) -> None:
    answer = Client(HTTP_HOST=HOST_A).get("/api/v1/me/")
    assert answer.headers["X-Frame-Options"] == "DENY"


def test_no_template_has_inline_script_or_handlers() -> None:
    """What the policy would block: an inline <script>, on* handlers, hx-on (run through eval)."""
    root = Path(__file__).resolve().parents[2] / "frontend" / "templates"
    for template in root.rglob("*.html"):
        text = template.read_text()
        for forbidden in ("<script>", " onclick=", " onload=", " onsubmit=", "hx-on", "javascript:"):
            assert forbidden not in text, (template, forbidden)


def test_klique_up_runs_without_debug_unless_asked() -> None:
    code = "import django.conf as c; from config.settings import local; print(local.DEBUG)"
    environment = {key: value for key, value in os.environ.items() if key != "DEBUG"}
    environment.setdefault("DATABASE_URL", "postgres://klique@127.0.0.1:5432/klique")
    shown = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == "False"
    asked = subprocess.run(
        [sys.executable, "-c", code],
        env={**environment, "DEBUG": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert asked.stdout.strip() == "True"


def test_a_large_output_is_streamed_to_the_store(
    world: World, served: tuple[str, int], django_db_blocker: object
) -> None:
    from tests.gateway.conftest import committed

    base, pid = served

    with schema_context("acme"):
        first = Task.objects.filter(pk=world.task_a).values("state", "pool_id", "lease_id").get()
    lease = uuid.uuid4()

    def put_on(state: str, pool: Any, lease: Any) -> None:
        with schema_context("acme"):
            Task.objects.filter(pk=world.task_a).update(state=state, pool_id=pool, lease_id=lease)
            if lease is not None and not TaskRun.objects.filter(pk=lease).exists():
                TaskRun.objects.create(
                    lease_id=lease,
                    task_id=world.task_a,
                    attempt=1,
                    pool_id=pool,
                    dispatched_at=timezone.now(),
                )
            TaskOutput.objects.filter(task_id=world.task_a, name__startswith="big-").delete()

    h100 = committed(django_db_blocker, _h100_id)
    committed(django_db_blocker, lambda: put_on(TaskState.RUNNING, h100, lease))
    try:
        headers = {
            "Host": HOST_A,
            "Authorization": f"Bearer {world.agent_secret_a}",
            "X-Klique-Lease": str(lease),
        }
        url = f"{base}/agents/v1/tasks/{world.task_a}/outputs/big-{time.monotonic_ns()}.bin"
        megabytes = 96

        def body() -> Iterator[bytes]:
            chunk = os.urandom(1024 * 1024)
            for _ in range(megabytes):
                yield chunk

        with httpx.Client(timeout=120) as client:
            assert client.get(f"{base}/healthz").status_code == 200
            before = memory_mb(pid, "VmHWM")
            octets = {**headers, "Content-Type": "application/octet-stream"}
            answer = client.put(url, content=body(), headers=octets)
    finally:  # the world is the session's: leave its task as it was
        committed(django_db_blocker, lambda: put_on(first["state"], first["pool_id"], first["lease_id"]))
    assert answer.status_code == 201, answer.text
    assert answer.json()["size"] == megabytes * 1024 * 1024
    assert (
        memory_mb(pid, "VmHWM") - before < megabytes / 2
    )  # the upload never sat in memory whole, let alone twice


def _h100_id() -> object:
    with schema_context("acme"):
        return Pool.objects.get(name="h100").pk
