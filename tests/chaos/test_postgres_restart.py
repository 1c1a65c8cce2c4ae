"""PostgreSQL killed with SIGKILL by PID under a running `klique up` while a task writes its output and
ends, then started again on its data: the task's result, every log line and its output arrive once the
database is back, the task ran once, the agent did not hammer the plane, and no request fails on a
connection the restart broke."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.test_agent_away import TASK, outbox, pool_of, state, wait
from tests.e2e.conftest import ROOT, clean_environment, start_up
from tests.e2e.test_agent_crash import Demo, agent_argv
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e


class Postgres:
    """A PostgreSQL of the test's own (pgserver's binaries, the embedded one's), on a unix socket."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    server: Any = None

    def start(self) -> None:
        """Start it, or start it again on its data after a kill (pgserver keeps one server per folder)."""
        from pgserver.postgres_server import get_server

        if self.server is None:
            self.server = get_server(self.folder, cleanup_mode="stop")
        else:
            self.server.ensure_postgres_running()

    def url(self, database: str) -> str:
        self.server.psql(f'CREATE DATABASE "{database}";')
        return f"postgresql://postgres@/{database}?host={self.folder}"

    def kill(self) -> None:
        pid = int((self.folder / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        wait("PostgreSQL to stop", lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 20)

    def stop(self) -> None:
        self.server.cleanup()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kqpg-") as folder:  # a short path: its socket lives there
        server = Postgres(Path(folder))
        server.start()
        yield server
        server.stop()
        logging.getLogger("pgserver").disabled = True  # its exit hook logs after pytest closed the stream


def test_a_postgres_restart_while_a_task_ends_loses_and_doubles_nothing(
    postgres: Postgres, redis_url: str, tmp_path: Path
) -> None:
    environment = clean_environment(DATABASE_URL=postgres.url("klique_chaos"), REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    agent: subprocess.Popen[Any] | None = None
    ledger, work_dir, agent_log = tmp_path / "ledger", tmp_path / "agent", tmp_path / "agent.log"
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        argv = agent_argv(f"http://demo.localhost:{running.port}", pool_of(demo), "rack-pg", work_dir)
        with open(agent_log, "w") as log:
            agent = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        spec = {"command": [sys.executable, "-c", TASK, "pg", "8", str(ledger)], "outputs": ["result.txt"]}
        body = {"compute_resource": "Research: rack", "spec": spec}
        task_id = str(demo.call("POST", "/api/v1/tasks/", json=body)["id"])
        wait("running", lambda: state(demo, task_id)["state"] == "running")

        postgres.kill()
        # (the agent reports running once it spawned the task: the task may not have made its ledger yet)
        wait(
            "the task to end while the database is down",
            lambda: ledger.exists() and "end pg" in ledger.read_text(),
            30,
        )
        time.sleep(3)  # its result, last lines and output wait: the plane cannot take them
        postgres.start()
        # Every pooled connection of the web was broken by the restart; each is checked as it leaves the
        # pool and replaced there, so no request fails for it.
        for _ in range(15):
            state(demo, task_id)

        final = wait("completed", lambda: (s := state(demo, task_id))["state"] == "completed" and s, 120)
        assert (final["attempts"], final["exit_code"]) == (1, 0), final
        assert demo.logged(task_id) == [f"pg step {i}" for i in range(8)]
        outputs = demo.call("GET", f"/api/v1/tasks/{task_id}/outputs/")
        assert [(output["name"], output["size"]) for output in outputs] == [("result.txt", len("pg done\n"))]
        assert ledger.read_text().splitlines() == ["start pg", "end pg"]
        wait("the agent's outbox to empty", lambda: outbox(work_dir) == 0, 30)
        # While the database was down the agent's messages waited for it (the web's pool waits up to 10 s
        # for a connection) or it backed off: a handful of reconnects at most, not one every second.
        attempts = agent_log.read_text().count("reconnecting in")
        assert attempts <= 12, agent_log.read_text()[-3000:]
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait(timeout=30)
        assert running.interrupt() == 0
