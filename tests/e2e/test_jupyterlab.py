"""JupyterLab from the catalogue, for real: launched from the portal on a bare-metal pool, opened through
its internal route in Chromium (the portal's sign-in, then the app's own host), a cell run on its kernel
over the websocket through the route, and stopped; someone it is not shared with gets 404."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.containers import Podman
from tests.e2e.conftest import RackDemo, installed, signed_in
from tests.e2e.test_apps import wait_state

pytestmark = pytest.mark.e2e

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's loop in the test's thread


@pytest.fixture(scope="session")
def jupyter() -> str:
    """JupyterLab installed for this host by the project's own script (ROOT/.tools/jupyterlab)."""
    return installed("jupyterlab")


def entry(jupyter: str) -> dict[str, Any]:
    return {
        "name": "jupyterlab-host",
        "version": "4",
        "title": "JupyterLab on the host",
        "kind": "ide",
        "command": [
            jupyter, "lab", "--no-browser", "--ip=127.0.0.1", "--port={port}", "--ServerApp.token=",
            "--ServerApp.password=", "--ServerApp.root_dir=.", "--ServerApp.trust_xheaders=True",
            "--ServerApp.allow_remote_access=True", "--allow-root", "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        "health": {"path": "/api", "startup_seconds": 120},
        "gpus": "1",
        "compute_resource": "Research: rack",
    }  # fmt: skip


def run_cell(page: Any, portal: str, app: dict[str, Any], code: str, expected: str) -> None:
    """Open the app at its stable address (on to its own host with a ticket), make a notebook, type `code`
    in its first cell and run it until `expected` is in its output."""
    page.goto(f"{portal}/apps/{app['id']}/")  # the stable address: on to the app's host with a ticket
    page.wait_for_selector(".jp-LauncherCard", timeout=120_000)
    assert page.url.startswith(app["url"])
    page.click('.jp-LauncherCard[data-category="Notebook"]')
    # As a person does: type once the kernel is connected, run, and run again if the page let the first
    # run go before its kernel was ready (the kernel's messages through the route say when it is).
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    page.locator(".jp-Notebook .jp-Cell .cm-content").first.click(timeout=60_000)
    page.keyboard.type(code)
    output = page.locator(".jp-OutputArea-output", has_text=expected)
    deadline = time.monotonic() + 120
    while output.count() == 0:
        assert time.monotonic() < deadline, (
            "the cell never ran",
            page.locator(".jp-Notebook .jp-Cell .cm-content").first.inner_text(),
            page.locator(".jp-OutputArea").all_inner_texts(),
        )
        page.locator(".jp-Notebook .jp-Cell .cm-content").first.click()
        page.keyboard.press("Control+Enter")  # run the cell, staying on it
        with contextlib.suppress(PlaywrightTimeout):
            output.wait_for(timeout=15_000)


def test_jupyterlab_is_launched_from_the_portal_and_runs_a_cell_through_its_route(
    jupyter: str, chromium: Any, rack_demo: RackDemo, tmp_path: Path
) -> None:
    demo, running = rack_demo.demo, rack_demo.running
    demo.call("POST", "/api/v1/catalogue/", json=entry(jupyter))
    page, portal = signed_in(chromium, running)
    page.click('details[data-entry="jupyterlab-host"] summary')
    page.click('details[data-entry="jupyterlab-host"] button[type=submit]')
    page.wait_for_selector('tr[data-state="starting"]', timeout=30_000)
    (app,) = demo.call("GET", "/api/v1/apps/")["results"]
    wait_state(demo, app["id"], "ready", timeout=180)

    run_cell(page, portal, app, "print(6 * 7, 'from the kernel')", "42 from the kernel")
    page.screenshot(path=str(tmp_path / "jupyterlab.png"))

    # Someone it is not shared with: 404 at its own host.
    stranger = demo.call("POST", "/api/v1/service-accounts/", json={"name": "stranger"})
    token = demo.call("POST", f"/api/v1/service-accounts/{stranger['id']}/tokens/", json={"name": "t"})[
        "token"
    ]
    host = app["url"].split("//", 1)[1].rstrip("/")
    refused = httpx.get(
        f"http://127.0.0.1:{running.port}/lab", headers={"Host": host, "Authorization": f"Bearer {token}"}
    )
    assert refused.status_code == 404

    demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
    wait_state(demo, app["id"], "stopped")
    page.goto(f"{portal}/apps/{app['id']}/")  # its address says so, and offers to start it again
    assert page.locator("[data-app-state='stopped']").count() == 1
    assert page.locator("button", has_text="again").count() == 1


def launched_on_the_rack(rack_demo: RackDemo, chromium: Any, entry: str) -> tuple[dict[str, Any], Any, str]:
    """A shipped entry launched through the API on the demo's bare-metal rack (one GPU, its size), once
    ready; a page signed in to the portal, and the portal's address."""
    launched = rack_demo.demo.call(
        "POST", "/api/v1/apps/", json={"entry": entry, "compute_resource": "Research: rack", "gpus": "1"}
    )
    app = wait_state(rack_demo.demo, launched["id"], "ready", timeout=240)
    page, portal = signed_in(chromium, rack_demo.running)
    return app, page, portal


def test_the_shipped_jupyterlab_entry_runs_in_its_own_image_through_its_route(
    shipped_images: Podman, chromium: Any, rack_demo: RackDemo, tmp_path: Path
) -> None:
    """The catalogue's own JupyterLab entry, as shipped: its image built on this host by the project's
    script, run by the bare-metal agent in a podman container, a cell run through the route in Chromium
    inside that image, on the task's folder at /work."""
    demo = rack_demo.demo
    app, page, portal = launched_on_the_rack(rack_demo, chromium, "jupyterlab")
    code = "import os, sys; print('in', sys.prefix, os.getcwd())"
    run_cell(page, portal, app, code, "in /opt/jupyter /work")  # the image's Python, on the task's folder
    page.screenshot(path=str(tmp_path / "jupyterlab-image.png"))
    demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
    stopped = wait_state(demo, app["id"], "stopped")
    assert stopped["state"] == "stopped"
    deadline = time.monotonic() + 30  # its container goes with it, once the engine has stopped it
    while "klique-jupyter" in (left := shipped_images.run("ps", "--all", "--format", "{{.Image}}").stdout):
        assert time.monotonic() < deadline, left
        time.sleep(0.5)


def test_the_shipped_agent_sandbox_calls_the_tenants_gateway_from_its_image_with_its_sessions_key(
    shipped_images: Podman, chromium: Any, rack_demo: RackDemo
) -> None:
    """The catalogue's agent sandbox, as shipped: in its image, the official `openai` client takes the
    gateway's address and the session's key from the environment the session gave it, and a model
    answers through the tenant's gateway."""
    demo = rack_demo.demo
    app, page, portal = launched_on_the_rack(rack_demo, chromium, "agent-sandbox")
    code = (
        "import openai; said = openai.OpenAI().chat.completions.create(model='demo-echo', "
        "messages=[{'role': 'user', 'content': 'hello sandbox'}], max_tokens=8); "
        "print('model says', said.choices[0].message.content)"
    )
    run_cell(page, portal, app, code, "model says hello sandbox")
    demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
    wait_state(demo, app["id"], "stopped")
