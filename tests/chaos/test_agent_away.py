"""Faults longer than a blink, with real processes killed by PID: `klique up` (web, worker, beat) on the
machine's PostgreSQL and Redis, a real agent, tasks that record each start and end on disk.

The bookkeeping is the test's own: every task appends "start" and "end" lines to a ledger file, so a run
started twice shows up there whatever the API says; the test compares the ledger with the API, the stored
logs and the agent's outbox."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ROOT, clean_environment, free_port, start_up
from tests.e2e.test_agent_crash import Demo, agent_argv
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

TIMEOUT = 5  # the pool's heartbeat timeout, seconds

# A task that records its start and end in the ledger, prints `steps` lines and writes an output file.
TASK = """
import sys, time
name, steps, ledger = sys.argv[1], int(sys.argv[2]), sys.argv[3]
open(ledger, "a").write(f"start {name}\\n")
for i in range(steps):
    print(f"{name} step {i}", flush=True)
    time.sleep(0.5)
open("result.txt", "w").write(f"{name} done\\n")
open(ledger, "a").write(f"end {name}\\n")
"""


def pool_of(demo: Demo) -> str:
    """Pool "rack" (2 GPUs, heartbeat timeout TIMEOUT s) with compute resource "Research: rack"."""
    return demo.pool_token(
        {
            "name": "rack",
            "environment": "baremetal",
            "capacity_gpus": 2,
            "heartbeat_timeout_seconds": TIMEOUT,
        },
        {"name": "one-gpu", "gpus": "1", "pools": [{"pool": "rack"}]},
        {"profile": "one-gpu", "name": "Research: rack"},
    )


def submit(demo: Demo, name: str, steps: int, ledger: Path) -> str:
    spec = {"command": [sys.executable, "-c", TASK, name, str(steps), str(ledger)], "outputs": ["result.txt"]}
    task: dict[str, Any] = demo.call("POST", "/api/v1/tasks/", json={"compute_resource": "Research: rack",
                                                                     "spec": spec})  # fmt: skip
    return str(task["id"])


def wait(what: str, check: Any, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def state(demo: Demo, task_id: str) -> dict[str, Any]:
    found: dict[str, Any] = demo.call("GET", f"/api/v1/tasks/{task_id}/")
    return found


def outbox(work_dir: Path) -> int:
    with sqlite3.connect(work_dir / "agent.sqlite") as db:
        return int(db.execute("SELECT count(*) FROM reports").fetchone()[0])


def test_an_agent_back_after_the_pools_timeout_keeps_finished_and_running_work(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    environment = clean_environment(
        DATABASE_URL=fresh_database, REDIS_URL=redis_url, KLIQUE_CYCLE_SAFETY_NET_SECONDS="1"
    )
    running = start_up(environment, tmp_path / "data")
    agent = None
    ledger, work_dir = tmp_path / "ledger", tmp_path / "agent"
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        argv = agent_argv(f"http://demo.localhost:{running.port}", pool_of(demo), "rack-1", work_dir)
        agent = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        short, long = submit(demo, "short", 12, ledger), submit(demo, "long", 40, ledger)
        for task_id in (short, long):
            wait("both running", lambda task_id=task_id: state(demo, task_id)["state"] == "running")
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        # Past the timeout the scheduler gives both runs up: they wait in the queue, saying why.
        for task_id in (short, long):
            lost = wait(
                "the runs given up",
                lambda task_id=task_id: (s := state(demo, task_id))["reason_code"] == "run_lost" and s,
            )
            assert "went silent" in lost["reason"], lost
        wait(
            "the short task to end while its agent is away",
            lambda: ledger.exists() and "end short" in ledger.read_text(),
            60,
        )
        agent = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        for task_id, steps in ((short, 12), (long, 40)):
            final = wait(
                "completed", lambda task_id=task_id: (s := state(demo, task_id))["state"] == "completed" and s
            )
            assert (final["attempts"], final["exit_code"]) == (1, 0), final
            name = "short" if task_id == short else "long"
            assert demo.logged(task_id) == [f"{name} step {i}" for i in range(steps)]  # each line once
            history = demo.call("GET", f"/api/v1/tasks/{task_id}/history/")
            assert [event["to_state"] for event in history].count(
                "dispatching"
            ) == 1  # never dispatched again
            assert any(event["message"].startswith("adopted: agent rack-1") for event in history), history
            outputs = demo.call("GET", f"/api/v1/tasks/{task_id}/outputs/")
            assert [output["name"] for output in outputs] == ["result.txt"]
        assert sorted(ledger.read_text().splitlines()) == [
            "end long",
            "end short",
            "start long",
            "start short",
        ]
        wait("the agent's outbox to empty", lambda: outbox(work_dir) == 0, 30)
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait(timeout=30)
        assert running.interrupt() == 0


def test_outputs_written_while_the_web_process_is_down_are_stored_once_it_is_back(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    """The agent's web process is killed while the task writes its output and ends; the upload is retried
    with backoff until a new web process takes it, and the task completes with its output stored."""
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    agent = web = None
    ledger = tmp_path / "ledger"
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        agent_token = pool_of(demo)
        port = free_port()
        web_argv = [sys.executable, "-m", "klique.cli", "web", "--port", str(port)]
        quiet = {"cwd": ROOT, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        web = subprocess.Popen(web_argv, env=environment, **quiet)  # type: ignore[call-overload]
        agent = subprocess.Popen(  # type: ignore[call-overload]
            agent_argv(f"http://demo.localhost:{port}", agent_token, "rack-web", tmp_path / "agent"), **quiet
        )
        task_id = submit(demo, "upload", 6, ledger)
        wait("running", lambda: state(demo, task_id)["state"] == "running")
        web.kill()
        web.wait(timeout=10)
        wait(
            "the task to end while the web is down",
            lambda: ledger.exists() and "end upload" in ledger.read_text(),
        )
        time.sleep(2)  # its upload is being retried
        web = subprocess.Popen(web_argv, env=environment, **quiet)  # type: ignore[call-overload]

        final = wait("completed", lambda: (s := state(demo, task_id))["state"] == "completed" and s)
        assert final["reason_code"] != "outputs_not_stored", final
        outputs = demo.call("GET", f"/api/v1/tasks/{task_id}/outputs/")
        assert [(output["name"], output["size"]) for output in outputs] == [
            ("result.txt", len("upload done\n"))
        ]
        assert demo.logged(task_id) == [f"upload step {i}" for i in range(6)]
    finally:
        for process in (agent, web):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        assert running.interrupt() == 0
