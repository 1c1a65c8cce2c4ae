"""Two real agents on one pool; the first is killed with SIGKILL while its task runs, and comes back after
the pool's timeout, when the second agent has run the task again. The second agent's hello never touched
the first one's run; the first run's late result is recorded as a duplicate run, never taken as the
task's; and no run's line is stored twice."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.test_agent_away import TIMEOUT, state, wait
from tests.e2e.conftest import ROOT, clean_environment, start_up
from tests.e2e.test_agent_crash import Demo, agent_argv
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

STEPS = 20
TASK = """
import os, sys, time
ledger, steps = sys.argv[1], int(sys.argv[2])
open(ledger, "a").write(f"start {os.environ['KLIQUE_TASK_ID']} {os.getcwd()}\\n")
for i in range(steps):
    print(f"step {i}", flush=True)
    time.sleep(0.5)
open(ledger, "a").write(f"end {os.getcwd()}\\n")
"""


def workers(demo: Demo) -> int:
    pools = demo.call("GET", "/api/v1/pools/")["results"]
    return int(next(row["workers"] for row in pools if row["name"] == "pair"))


def test_a_run_given_up_and_run_again_by_the_second_agent_is_recorded_as_a_duplicate_not_the_result(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    environment = clean_environment(
        DATABASE_URL=fresh_database, REDIS_URL=redis_url, KLIQUE_CYCLE_SAFETY_NET_SECONDS="1"
    )
    running = start_up(environment, tmp_path / "data")
    agents: dict[str, subprocess.Popen[Any]] = {}
    ledger = tmp_path / "ledger"
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        pool = {
            "name": "pair",
            "environment": "baremetal",
            "capacity_gpus": 2,
            "heartbeat_timeout_seconds": TIMEOUT,
        }
        first_token = demo.pool_token(
            pool,
            {"name": "pair-gpu", "gpus": "1", "pools": [{"pool": "pair"}]},
            {"profile": "pair-gpu", "name": "Research: pair"},
        )
        pool_id = next(
            row["id"] for row in demo.call("GET", "/api/v1/pools/")["results"] if row["name"] == "pair"
        )
        second_token = demo.call("POST", f"/api/v1/pools/{pool_id}/agent-tokens/", json={"name": "b"})[
            "token"
        ]
        url = f"http://demo.localhost:{running.port}"
        argv = {
            "a": agent_argv(url, first_token, "pair-a", tmp_path / "a"),
            "b": agent_argv(url, second_token, "pair-b", tmp_path / "b"),
        }

        def start(name: str) -> None:
            agents[name] = subprocess.Popen(
                argv[name], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )

        start("a")
        spec = {"command": [sys.executable, "-c", TASK, str(ledger), str(STEPS)]}
        task_id = str(
            demo.call("POST", "/api/v1/tasks/", json={"compute_resource": "Research: pair", "spec": spec})[
                "id"
            ]
        )
        wait("running on the first agent", lambda: state(demo, task_id)["state"] == "running")
        wait("some output", lambda: len(demo.logged(task_id)) >= 2)
        start("b")  # its hello concerns its own runs: the first agent's goes on
        wait("both agents connected", lambda: workers(demo) == 2)
        agents["a"].send_signal(signal.SIGKILL)
        agents["a"].wait(timeout=10)
        first_lines = len(demo.logged(task_id))

        # Past the timeout the first agent's run is given up; the pool is online through the second agent,
        # which runs the task again.
        wait("a second start", lambda: ledger.read_text().count("start ") == 2, 60)
        wait("the first run to end while its agent is away", lambda: str(tmp_path / "a") in "".join(
            line for line in ledger.read_text().splitlines() if line.startswith("end ")), 60)  # fmt: skip
        start("a")

        final = wait("completed", lambda: (s := state(demo, task_id))["state"] == "completed" and s, 90)
        history = demo.call("GET", f"/api/v1/tasks/{task_id}/history/")
        said = [(event["actor"], event["to_state"], event["message"]) for event in history]
        assert (final["attempts"], final["exit_code"]) == (2, 0), said
        assert [state for _, state, _ in said].count("dispatching") == 2, said  # lost once, run once more
        messages = [event["message"] for event in history]
        assert any(
            message.startswith("duplicate run: attempt 1 ended with exit code 0") for message in messages
        ), messages
        assert any("attempt 1 was lost" in message for message in messages), messages
        logged = demo.logged(task_id)
        # The first run's lines up to its loss, then the second run's, each once: the first run's late lines
        # were stale.
        steps = [f"step {i}" for i in range(STEPS)]
        head = logged[: len(logged) - STEPS]
        assert logged[len(head) :] == steps, logged
        assert head == steps[: len(head)], logged
        assert first_lines <= len(head) < STEPS, (first_lines, logged)
    finally:
        for process in agents.values():
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        assert running.interrupt() == 0
