"""A real agent killed with SIGKILL in the middle of a task, then started again."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ROOT, clean_environment, free_port, start_up
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

COUNTING = "import time\nfor i in range(12):\n    print(f'step {i}', flush=True)\n    time.sleep(0.25)\n"


def test_a_killed_agent_comes_back_to_its_task_and_nothing_is_lost_or_doubled(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    agent = None
    try:
        token = running.wait_for(BANNER_CURL)[1]
        base = f"http://127.0.0.1:{running.port}"
        headers = {"Host": f"demo.localhost:{running.port}", "Authorization": f"Bearer {token}"}

        def call(method: str, path: str, **kwargs: Any) -> Any:
            response = httpx.request(method, base + path, headers=headers, timeout=30, **kwargs)
            assert response.status_code < 300, response.text
            return response.json() if response.content else None

        # A pool of its own, served by an agent this test controls.
        document = call("GET", "/api/v1/configuration/draft/")["document"]
        document["pools"].append({"name": "rack", "environment": "baremetal", "capacity_gpus": 2})
        document["profiles"].append({"name": "one-gpu", "gpus": "1", "pools": [{"pool": "rack"}]})
        document["policies"][0]["compute_resources"].append({"profile": "one-gpu", "name": "Research: rack"})
        call("PUT", "/api/v1/configuration/draft/", json={"document": document})
        call("POST", "/api/v1/configuration/draft/provision/")
        rack = next(pool for pool in call("GET", "/api/v1/pools/")["results"] if pool["name"] == "rack")
        agent_token = call("POST", f"/api/v1/pools/{rack['id']}/agent-tokens/", json={"name": "rack"})[
            "token"
        ]
        agent_argv = [
            sys.executable,
            "-m",
            "agents.main",
            "--url",
            f"http://demo.localhost:{running.port}",
            "--token",
            agent_token,
            "--gpus",
            "2",
            "--agent-id",
            "rack-1",
            "--work-dir",
            str(tmp_path / "agent"),
        ]
        agent = subprocess.Popen(agent_argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        task = call(
            "POST",
            "/api/v1/tasks/",
            json={
                "compute_resource": "Research: rack",
                "spec": {"command": [sys.executable, "-c", COUNTING]},
            },
        )

        follower = subprocess.Popen(
            [sys.executable, "-m", "klique.cli", "logs", "-f", task["id"]],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**environment, "KLIQUE_URL": f"http://demo.localhost:{running.port}", "KLIQUE_TOKEN": token},
        )

        def logged() -> list[str]:
            return [
                line for chunk in call("GET", f"/api/v1/tasks/{task['id']}/logs/") for line in chunk["lines"]
            ]

        deadline = time.monotonic() + 60
        while len(logged()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert 3 <= len(logged()) < 12, logged()
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        time.sleep(1)  # the task goes on without its agent
        agent = subprocess.Popen(agent_argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        deadline = time.monotonic() + 60
        while (
            call("GET", f"/api/v1/tasks/{task['id']}/")["state"] != "completed"
            and time.monotonic() < deadline
        ):
            time.sleep(0.3)
        final = call("GET", f"/api/v1/tasks/{task['id']}/")
        assert (final["state"], final["attempts"], final["exit_code"]) == ("completed", 1, 0)
        assert logged() == [f"step {i}" for i in range(12)]
        history = [event["to_state"] for event in call("GET", f"/api/v1/tasks/{task['id']}/history/")]
        assert history == ["queued", "placed", "dispatching", "running", "completed"]  # it ran once
        # Someone following the output live saw every line once, across the agent's crash.
        live = follower.communicate(timeout=60)[0].splitlines()
        assert live == [*(f"step {i}" for i in range(12)), "-- task completed --"], live
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait(timeout=30)
        assert running.interrupt() == 0


def test_a_cut_connection_loses_and_doubles_nothing(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    """The agent talks to a web process of its own; that process dies mid-task (the socket is cut) and a new
    one takes its port. The agent reconnects and replays what was not acknowledged: each line once."""
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    agent = web = None
    try:
        token = running.wait_for(BANNER_CURL)[1]
        headers = {"Host": f"demo.localhost:{running.port}", "Authorization": f"Bearer {token}"}

        def call(method: str, path: str, **kwargs: Any) -> Any:
            response = httpx.request(
                method, f"http://127.0.0.1:{running.port}{path}", headers=headers, timeout=30, **kwargs
            )
            assert response.status_code < 300, response.text
            return response.json() if response.content else None

        document = call("GET", "/api/v1/configuration/draft/")["document"]
        document["pools"].append({"name": "rack", "environment": "baremetal", "capacity_gpus": 2})
        document["profiles"].append({"name": "one-gpu", "gpus": "1", "pools": [{"pool": "rack"}]})
        document["policies"][0]["compute_resources"].append({"profile": "one-gpu", "name": "Research: rack"})
        call("PUT", "/api/v1/configuration/draft/", json={"document": document})
        call("POST", "/api/v1/configuration/draft/provision/")
        rack = next(pool for pool in call("GET", "/api/v1/pools/")["results"] if pool["name"] == "rack")
        agent_token = call("POST", f"/api/v1/pools/{rack['id']}/agent-tokens/", json={"name": "rack"})[
            "token"
        ]

        port = free_port()
        web_argv = [sys.executable, "-m", "klique.cli", "web", "--port", str(port)]
        web = subprocess.Popen(
            web_argv, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agents.main",
                "--url",
                f"http://demo.localhost:{port}",
                "--token",
                agent_token,
                "--gpus",
                "2",
                "--agent-id",
                "rack-cut",
                "--work-dir",
                str(tmp_path / "agent"),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        task = call(
            "POST",
            "/api/v1/tasks/",
            json={
                "compute_resource": "Research: rack",
                "spec": {"command": [sys.executable, "-c", COUNTING]},
            },
        )

        def logged() -> list[str]:
            return [
                line for chunk in call("GET", f"/api/v1/tasks/{task['id']}/logs/") for line in chunk["lines"]
            ]

        deadline = time.monotonic() + 60
        while len(logged()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert 3 <= len(logged()) < 12
        web.kill()  # the socket is cut mid-stream; the task goes on and its output piles up in the outbox
        web.wait(timeout=10)
        time.sleep(4)  # long enough for the task to end while cut off: its result waits in the outbox
        web = subprocess.Popen(
            web_argv, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        deadline = time.monotonic() + 90
        while (
            call("GET", f"/api/v1/tasks/{task['id']}/")["state"] != "completed"
            and time.monotonic() < deadline
        ):
            time.sleep(0.3)
        assert call("GET", f"/api/v1/tasks/{task['id']}/")["state"] == "completed"
        assert logged() == [f"step {i}" for i in range(12)]
    finally:
        for process in (agent, web):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        assert running.interrupt() == 0
