"""VS Code in the browser from the catalogue, for real: npm's code-server (built for this host by the
project's own script) launched on a bare-metal pool and opened through its internal route in Chromium. The
workbench lists, opens, edits and saves a file of its folder: VS Code's remote file system and extension
host speak over a websocket through the route. Stopped, its route says so."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.containers import Podman
from tests.e2e.conftest import RackDemo, installed, signed_in
from tests.e2e.test_apps import wait_state
from tests.e2e.test_jupyterlab import launched_on_the_rack

pytestmark = pytest.mark.e2e

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's loop in the test's thread


@pytest.fixture(scope="session")
def code_server() -> str:
    """code-server installed for this host by the project's own script (ROOT/.tools/code-server)."""
    return installed("code-server")


def entry(code_server: str, folder: Path) -> dict[str, Any]:
    """The shipped entry's command, with the host's code-server, its own settings folders, and `folder`
    open (the project's shared files, where an image's entry has /work)."""
    return {
        "name": "code-server-host",
        "version": "4",
        "title": "VS Code on the host",
        "kind": "ide",
        "command": [
            code_server, "--bind-addr=127.0.0.1:{port}", "--auth=none", "--disable-telemetry",
            "--disable-update-check", "--disable-workspace-trust",
            f"--user-data-dir={folder.parent / 'vscode-user'}",
            f"--extensions-dir={folder.parent / 'vscode-extensions'}", str(folder),
        ],
        "health": {"path": "/healthz", "startup_seconds": 120},
        "gpus": "1",
        "compute_resource": "Research: rack",
    }  # fmt: skip


def answers_the_trust_prompt(page: Any) -> None:
    """Trusts the folder whenever VS Code asks. The shipped entry keeps VS Code's workspace trust on (the
    project's shared files may be written by others), so a fresh workbench asks once whether to trust
    `/work`. It asks a second or two after the workbench shows, and the modal takes every click meanwhile;
    the handler answers it before any later action, whenever it came."""
    asking = "Do you trust the authors of the files in this folder?"
    prompt = page.locator(".monaco-dialog-box", has_text=asking)
    page.add_locator_handler(
        prompt, lambda: prompt.get_by_role("button", name="Yes, I trust the authors").click(), times=1
    )


def test_code_server_opens_a_file_of_its_folder_through_its_route(
    code_server: str, chromium: Any, rack_demo: RackDemo, tmp_path: Path
) -> None:
    demo, running = rack_demo.demo, rack_demo.running
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "train.py").write_text("print('hello from the shared files')\n")
    demo.call("POST", "/api/v1/catalogue/", json=entry(code_server, folder))
    launched = demo.call("POST", "/api/v1/apps/", json={"entry": "code-server-host"})
    app = wait_state(demo, launched["id"], "ready", timeout=180)

    page, portal = signed_in(chromium, running)
    page.goto(f"{portal}/apps/{app['id']}/")  # the stable address: on to the app's host with a ticket
    page.wait_for_selector(".monaco-workbench", timeout=120_000)
    assert page.url.startswith(app["url"])
    listed = page.locator(".explorer-folders-view .monaco-list-row", has_text="train.py")
    listed.wait_for(timeout=120_000)  # the folder, read over the websocket through the route
    listed.dblclick()
    page.locator(".editor-container .view-lines", has_text="hello from the shared files").wait_for(
        timeout=60_000
    )
    # A write goes back the same way: typed in the editor, saved, and on the host's disk.
    page.locator(".editor-container .view-lines").click()
    page.keyboard.press("Control+End")
    page.keyboard.type("# saved through the route")
    page.keyboard.press("Control+S")
    deadline = time.monotonic() + 30
    while "# saved through the route" not in (folder / "train.py").read_text():
        assert time.monotonic() < deadline, (folder / "train.py").read_text()
        time.sleep(0.3)
    page.screenshot(path=str(tmp_path / "code-server.png"))

    demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
    wait_state(demo, app["id"], "stopped")
    page.goto(f"{portal}/apps/{app['id']}/")
    assert page.locator("[data-app-state='stopped']").count() == 1


def test_the_shipped_code_server_entry_runs_in_its_own_image_through_its_route(
    shipped_images: Podman, chromium: Any, rack_demo: RackDemo, tmp_path: Path
) -> None:
    """The catalogue's own code-server entry, as shipped: its image built on this host by the project's
    script, run by the bare-metal agent in a podman container; its workbench, through the route in
    Chromium, lists the task's folder at /work (the run's output log is there) and opens a file of it."""
    app, page, portal = launched_on_the_rack(rack_demo, chromium, "code-server")
    answers_the_trust_prompt(page)
    page.goto(f"{portal}/apps/{app['id']}/")
    page.wait_for_selector(".monaco-workbench", timeout=120_000)
    assert page.url.startswith(app["url"])
    listed = page.locator(".explorer-folders-view .monaco-list-row", has_text="output.log")
    listed.wait_for(timeout=120_000)
    listed.dblclick()
    page.locator(".editor-container .view-lines", has_text="code-server 4.100.3").wait_for(timeout=60_000)
    page.screenshot(path=str(tmp_path / "code-server-image.png"))
    rack_demo.demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
    wait_state(rack_demo.demo, app["id"], "stopped")
