"""A real agent killed with SIGKILL in the middle of a task, then started again."""

from __future__ import annotations

import os
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


class Demo:
    """The demo tenant of a running `klique up`, through its API, as its admin."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token
        self.headers = {"Host": f"demo.localhost:{port}", "Authorization": f"Bearer {token}"}

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = httpx.request(
            method, f"http://127.0.0.1:{self.port}{path}", headers=self.headers, timeout=30, **kwargs
        )
        assert response.status_code < 300, response.text
        return response.json() if response.content else None

    def rack_pool_token(self) -> str:
        """Provision a pool "rack" of 2 GPUs with compute resource "Research: rack"; its agent token."""
        return self.pool_token(
            {"name": "rack", "environment": "baremetal", "capacity_gpus": 2},
            {"name": "one-gpu", "gpus": "1", "pools": [{"pool": "rack"}]},
            {"profile": "one-gpu", "name": "Research: rack"},
        )

    def pool_token(self, pool: dict[str, Any], profile: dict[str, Any], resource: dict[str, Any]) -> str:
        """Provision a pool, a profile of it and a compute resource of the first policy; the pool's agent
        token."""
        document = self.call("GET", "/api/v1/configuration/draft/")["document"]
        document["pools"].append(pool)
        document["profiles"].append(profile)
        document["policies"][0]["compute_resources"].append(resource)
        self.call("PUT", "/api/v1/configuration/draft/", json={"document": document})
        self.call("POST", "/api/v1/configuration/draft/provision/")
        made = next(
            row for row in self.call("GET", "/api/v1/pools/")["results"] if row["name"] == pool["name"]
        )
        token: str = self.call(
            "POST", f"/api/v1/pools/{made['id']}/agent-tokens/", json={"name": pool["name"]}
        )["token"]
        return token

    def submit_counting(self) -> dict[str, Any]:
        task: dict[str, Any] = self.call(
            "POST",
            "/api/v1/tasks/",
            json={
                "compute_resource": "Research: rack",
                "spec": {"command": [sys.executable, "-c", COUNTING]},
            },
        )
        return task

    def logged(self, task_id: str) -> list[str]:
        return [
            line for chunk in self.call("GET", f"/api/v1/tasks/{task_id}/logs/") for line in chunk["lines"]
        ]

    def wait_for_lines(self, task_id: str, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.logged(task_id)) < count and time.monotonic() < deadline:
            time.sleep(0.2)

    def wait_until_completed(self, task_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + 90
        while (
            self.call("GET", f"/api/v1/tasks/{task_id}/")["state"] != "completed"
            and time.monotonic() < deadline
        ):
            time.sleep(0.3)
        task: dict[str, Any] = self.call("GET", f"/api/v1/tasks/{task_id}/")
        return task


def agent_argv(url: str, token: str, agent_id: str, work_dir: Path) -> list[str]:
    token_file = work_dir.parent / f"{agent_id}.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    return [
        sys.executable,
        "-m",
        "agents.main",
        "--url",
        url,
        "--token-file",
        str(token_file),
        "--gpus",
        "2",
        "--agent-id",
        agent_id,
        "--work-dir",
        str(work_dir),
    ]


def test_a_killed_agent_comes_back_to_its_task_and_nothing_is_lost_or_doubled(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    agent = None
    try:
        token = running.wait_for(BANNER_CURL)[1]
        demo = Demo(running.port, token)
        argv = agent_argv(
            f"http://demo.localhost:{running.port}", demo.rack_pool_token(), "rack-1", tmp_path / "agent"
        )
        agent = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        task = demo.submit_counting()
        follower = subprocess.Popen(
            [sys.executable, "-m", "klique.cli", "logs", "-f", task["id"]],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**environment, "KLIQUE_URL": f"http://demo.localhost:{running.port}", "KLIQUE_TOKEN": token},
        )
        demo.wait_for_lines(task["id"], 3)
        assert 3 <= len(demo.logged(task["id"])) < 12, demo.logged(task["id"])
        rack = next(row for row in demo.call("GET", "/api/v1/pools/")["results"] if row["name"] == "rack")
        assert (rack["workers"], rack["cpus"], rack["nodes"]) == (1, os.cpu_count(), 1)  # the agent's hello
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        time.sleep(1)  # the task goes on without its agent
        agent = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        final = demo.wait_until_completed(task["id"])
        assert (final["state"], final["attempts"], final["exit_code"]) == ("completed", 1, 0)
        assert demo.logged(task["id"]) == [f"step {i}" for i in range(12)]
        history = [event["to_state"] for event in demo.call("GET", f"/api/v1/tasks/{task['id']}/history/")]
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
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        agent_token = demo.rack_pool_token()
        port = free_port()
        web_argv = [sys.executable, "-m", "klique.cli", "web", "--port", str(port)]
        quiet = {"cwd": ROOT, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        web = subprocess.Popen(web_argv, env=environment, **quiet)  # type: ignore[call-overload]
        agent = subprocess.Popen(  # type: ignore[call-overload]
            agent_argv(f"http://demo.localhost:{port}", agent_token, "rack-cut", tmp_path / "agent"), **quiet
        )
        task = demo.submit_counting()
        demo.wait_for_lines(task["id"], 3)
        assert 3 <= len(demo.logged(task["id"])) < 12
        web.kill()  # the socket is cut mid-stream; the task goes on and its output piles up in the outbox
        web.wait(timeout=10)
        time.sleep(4)  # long enough for the task to end while cut off: its result waits in the outbox
        web = subprocess.Popen(web_argv, env=environment, **quiet)  # type: ignore[call-overload]

        assert demo.wait_until_completed(task["id"])["state"] == "completed"
        assert demo.logged(task["id"]) == [f"step {i}" for i in range(12)]
    finally:
        for process in (agent, web):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        assert running.interrupt() == 0
