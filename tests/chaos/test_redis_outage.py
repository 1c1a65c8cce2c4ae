"""Redis killed by PID under a running `klique up` (its broker, channel layer and counters) and started
again on its port: an abort given during the outage is honoured, a live log follower sees every line and
the end, and the pool's next task runs once the stopped run has let its GPU go. Celery's consumer does
not always survive the restart (config/watchdog.py): then the worker ends itself and `klique up` starts it
again, and the marks of periodic work, lost with Redis's data, are found by the next walk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from klique.embedded import port_open, redis_executable
from tests.chaos.test_agent_away import state, wait
from tests.e2e.conftest import ROOT, clean_environment, free_port, start_up
from tests.e2e.test_agent_crash import Demo, agent_argv
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

# Prints a line every 0.3 s for a minute; says in the ledger when it starts (with its process id) and ends.
TASK = """
import os, sys, time
name, steps, ledger = sys.argv[1], int(sys.argv[2]), sys.argv[3]
open(ledger, "a").write(f"start {name} {os.getpid()}\\n")
for i in range(steps):
    print(f"{name} step {i}", flush=True)
    time.sleep(0.3)
open(ledger, "a").write(f"end {name}\\n")
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has stopped


class Redis:
    """A Redis of the test's own on a fixed port, killed with SIGKILL and started again on that port."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.process: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [redis_executable(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.folder)]  # fmt: skip
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait("Redis to listen", lambda: port_open("127.0.0.1", self.port), 10)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    server = Redis(tmp_path / "redis")
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.kill()


def test_an_abort_during_a_redis_outage_is_honoured_and_a_follower_misses_nothing(
    fresh_database: str, redis: Redis, tmp_path: Path
) -> None:
    environment = clean_environment(
        DATABASE_URL=fresh_database,
        REDIS_URL=redis.url,
        KLIQUE_CYCLE_SAFETY_NET_SECONDS="1",
        KLIQUE_WORKER_STALL_SECONDS="20",  # a worker whose consumer the outage took ends, and comes back
    )
    running = start_up(environment, tmp_path / "data")
    agent = follower = None
    ledger = tmp_path / "ledger"
    try:
        token = running.wait_for(BANNER_CURL)[1]
        demo = Demo(running.port, token)
        agent_token = demo.pool_token(  # one GPU: the next task waits for the first to let it go
            {"name": "solo", "environment": "baremetal", "capacity_gpus": 1},
            {"name": "solo-gpu", "gpus": "1", "pools": [{"pool": "solo"}]},
            {"profile": "solo-gpu", "name": "Research: solo"},
        )
        argv = agent_argv(f"http://demo.localhost:{running.port}", agent_token, "solo-1", tmp_path / "agent")
        agent_log = (tmp_path / "agent.log").open("wb")
        agent = subprocess.Popen(argv, cwd=ROOT, stdout=agent_log, stderr=subprocess.STDOUT)

        def submit(name: str, steps: int) -> str:
            spec = {"command": [sys.executable, "-c", TASK, name, str(steps), str(ledger)]}
            body = {"compute_resource": "Research: solo", "spec": spec}
            return str(demo.call("POST", "/api/v1/tasks/", json=body)["id"])

        first = submit("first", 200)
        wait("the first task running", lambda: state(demo, first)["state"] == "running")
        follower = subprocess.Popen(
            [sys.executable, "-m", "klique.cli", "logs", "-f", first],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**environment, "KLIQUE_URL": f"http://demo.localhost:{running.port}", "KLIQUE_TOKEN": token},
        )
        wait("some output", lambda: len(demo.logged(first)) >= 3)
        second = submit("second", 3)  # waits: the pool's one GPU is the first task's

        redis.kill()
        time.sleep(1)
        cancelled = demo.call("POST", f"/api/v1/tasks/{first}/cancel/")
        assert cancelled["state"] == "aborted"
        # The live notice went nowhere; the agent's next heartbeat is answered with the abort.
        pid = int(ledger.read_text().split()[2])
        wait("the first run stopped", lambda: not alive(pid), 40)
        time.sleep(2)
        redis.start()

        try:
            final = wait(
                "the second task to complete",
                lambda: (s := state(demo, second))["state"] == "completed" and s,
                150,  # the worker's reconnect backoff after the outage comes first
            )
        except AssertionError:
            printed = []
            while not running._queue.empty():
                printed.append(running._queue.get_nowait())
            seen = {
                "second": state(demo, second),
                "history": demo.call("GET", f"/api/v1/tasks/{second}/history/"),
                "first": demo.call("GET", f"/api/v1/tasks/{first}/history/"),
            }
            plane = [line for line in printed if "klique.access" not in line]  # the polls above, not news
            agent_said = "\n".join((tmp_path / "agent.log").read_text(errors="replace").splitlines()[-40:])
            raise AssertionError(f"{seen}\n{''.join(plane[-80:])}\nagent:\n{agent_said}") from None
        assert (final["attempts"], final["exit_code"]) == (1, 0), final
        history = demo.call("GET", f"/api/v1/tasks/{second}/history/")
        assert [event["to_state"] for event in history].count("dispatching") == 1, history  # never refused
        lines = [" ".join(line.split()[:2]) for line in ledger.read_text().splitlines()]
        assert lines == ["start first", "start second", "end second"]  # the first never ended
        assert state(demo, first)["state"] == "aborted"

        shown = follower.communicate(timeout=60)[0].splitlines()
        stored = demo.logged(first)
        assert shown == [*stored, "-- task aborted --"], shown  # every line once, then the end
        assert stored == [f"first step {i}" for i in range(len(stored))]
    finally:
        for process in (follower, agent):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        assert running.interrupt() == 0
