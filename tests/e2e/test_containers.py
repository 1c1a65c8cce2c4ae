"""Tasks with an image through the whole of Klique: submitted through the API, dispatched to a real
bare-metal agent, run in a real podman container; the user reads the container's output through the API,
and a task whose image is not on the host fails with a reason that names it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.containers import Podman
from tests.e2e.conftest import ROOT, clean_environment, start_up
from tests.e2e.test_agent_crash import Demo, agent_argv
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

ENDED = {"completed", "failed", "aborted"}


def wait_ended(demo: Demo, task_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while (task := demo.call("GET", f"/api/v1/tasks/{task_id}/"))["state"] not in ENDED:
        assert time.monotonic() < deadline, task
        time.sleep(0.3)
    return task  # type: ignore[no-any-return]


def test_a_task_runs_in_its_image_and_a_missing_image_is_named_in_the_reason(
    podman: Podman, fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    # The fixture set CONTAINERS_CONF and the engine for this process; the agent inherits them.
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    agent = None
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        argv = agent_argv(
            f"http://demo.localhost:{running.port}",
            demo.rack_pool_token(),
            "rack-1",
            tmp_path / "data" / "rack",
        )
        with (tmp_path / "agent.log").open("w") as log:
            agent = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        script = 'if [ -d /usr/lib ]; then echo on-the-host; else echo "in the image, epochs=$EPOCHS"; fi'
        good = demo.call(
            "POST",
            "/api/v1/tasks/",
            json={
                "compute_resource": "Research: rack",
                "spec": {
                    "command": ["sh", "-c", script],
                    "image": podman.image,
                    "environment": {"EPOCHS": "2"},
                },
            },
        )
        missing = demo.call(
            "POST",
            "/api/v1/tasks/",
            json={
                "compute_resource": "Research: rack",
                "max_attempts": 1,
                "spec": {"command": ["true"], "image": "localhost/klique-not-loaded:1"},
            },
        )
        ran = wait_ended(demo, good["id"])
        assert ran["state"] == "completed", ran
        assert "in the image, epochs=2" in demo.logged(good["id"])
        failed = wait_ended(demo, missing["id"])
        assert (failed["state"], failed["exit_code"]) == ("failed", 97)
        assert "the image localhost/klique-not-loaded:1 is not on this host" in failed["reason"], failed
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        assert running.interrupt() == 0
