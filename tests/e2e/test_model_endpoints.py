"""A model endpoint through the whole of Klique: an app that serves a model (the gateway's OpenAI-compatible
echo server standing in for vLLM, started by the same kind of template) launched on a real bare-metal
agent, registered in the tenant's gateway while it runs, called with the official `openai` client through
the gateway and the app's tunnel, stopped for idleness with its GPU handed back, started again by the next
call, and taken out of the gateway when its owner stops it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import openai
import pytest

from tests.e2e.conftest import ROOT, RackDemo
from tests.e2e.test_apps import wait_state

pytestmark = pytest.mark.e2e

ECHO_SERVER = "import sys; sys.path.insert(0, sys.argv.pop(1)); from gateway.echo import main; main()"
TEMPLATE = {
    "name": "echo-model",
    "version": "1",
    "title": "Echo model",
    "kind": "model",
    "command": [sys.executable, "-c", ECHO_SERVER, str(ROOT), "--port", "{port}"],
    "health": {"path": "/v1/models", "startup_seconds": 60},
    "gpus": "1",
    "variables": [{"name": "SERVED_NAME", "description": "The model's name.", "default": "model"}],
    "serves": {"model_variable": "SERVED_NAME", "mode": "chat", "when_idle": "scale_to_zero"},
    "idle_timeout_seconds": 60,
}


def client(port: int, token: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key=token,
        default_headers={"Host": f"demo.localhost:{port}"},
        max_retries=0,
        timeout=180,
    )


def listed(gateway: openai.OpenAI) -> set[str]:
    return {model.id for model in gateway.models.list()}


def reclaim_an_hour_later(rack_demo: RackDemo) -> str:
    """The idle reclaim as its periodic task runs it, as if an hour had passed without a call."""
    code = (
        "from datetime import timedelta; from django.utils import timezone; "
        "from django_tenants.utils import schema_context; from tenants.models import Tenant; "
        "from apps.catalogue.services import apps_reclaim_idle\n"
        "tenant = Tenant.objects.get(slug='demo')\n"
        "with schema_context(tenant.schema_name):\n"
        "    later = timezone.now() + timedelta(hours=1)\n"
        "    print([app.name for app in apps_reclaim_idle(tenant=tenant, now=later)])"
    )
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        env={**os.environ, **rack_demo.environment},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_model_endpoint_serves_through_the_gateway_sleeps_when_idle_and_wakes_on_a_call(
    rack_demo: RackDemo,
) -> None:
    demo, port = rack_demo.demo, rack_demo.running.port
    demo.call("POST", "/api/v1/catalogue/", json=TEMPLATE)
    launch = {
        "entry": "echo-model",
        "compute_resource": "Research: rack",
        "variables": {"SERVED_NAME": "tiny-echo"},
    }
    app = demo.call("POST", "/api/v1/apps/", json=launch)
    first_task = app["task_id"]
    wait_state(demo, app["id"], "ready")

    gateway = client(port, demo.token)
    assert "tiny-echo" in listed(gateway)
    answer = gateway.chat.completions.create(
        model="tiny-echo", messages=[{"role": "user", "content": "hello through the tunnel"}], max_tokens=6
    )
    assert answer.choices[0].message.content == "hello through the tunnel hello through"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 6
    chunks = gateway.chat.completions.create(
        model="tiny-echo", messages=[{"role": "user", "content": "one two"}], max_tokens=4, stream=True
    )
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        == "one two one two"
    )

    # Someone the app is not shared with neither sees nor reaches its model.
    stranger = demo.call("POST", "/api/v1/service-accounts/", json={"name": "stranger"})
    token = demo.call("POST", f"/api/v1/service-accounts/{stranger['id']}/tokens/", json={"name": "t"})[
        "token"
    ]
    outsider = client(port, token)
    assert "tiny-echo" not in listed(outsider)
    with pytest.raises(openai.NotFoundError):
        outsider.chat.completions.create(model="tiny-echo", messages=[{"role": "user", "content": "hi"}])

    # An hour without a call: stopped, its GPU back in the pool, its model still listed.
    assert reclaim_an_hour_later(rack_demo) == "['Echo model']"
    asleep = wait_state(demo, app["id"], "stopped")
    assert "The next call to its model through the gateway starts it again." in asleep["detail"], asleep
    assert demo.call("GET", f"/api/v1/tasks/{first_task}/")["state"] == "aborted"
    assert "tiny-echo" in listed(gateway)

    # The next call starts it again and waits for it.
    started = time.monotonic()
    woken = gateway.chat.completions.create(
        model="tiny-echo", messages=[{"role": "user", "content": "wake up"}], max_tokens=2
    )
    assert woken.choices[0].message.content == "wake up"
    again = demo.call("GET", f"/api/v1/apps/{app['id']}/")
    assert again["state"] == "ready", again
    assert again["task_id"] != first_task
    assert time.monotonic() - started < 120

    # The calls were metered to the caller, as any gateway call, each by the app that answered.
    deadline = time.monotonic() + 30
    while len(rows := demo.call("GET", "/api/v1/gateway/usage/?model=tiny-echo")["results"]) < 3:
        assert time.monotonic() < deadline, rows
        time.sleep(0.5)
    assert {row["deployment"] for row in rows} == {f"tiny-echo#app-{app['id']}"}, rows
    assert {row["status"] for row in rows} == {"ok"}

    # Its owner stops it: the model leaves the gateway.
    demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
    wait_state(demo, app["id"], "stopped")
    assert "tiny-echo" not in listed(gateway)
    with pytest.raises(openai.NotFoundError):
        gateway.chat.completions.create(model="tiny-echo", messages=[{"role": "user", "content": "hi"}])
