"""A secret through the whole of Klique: kept through the API, handed to a real agent at dispatch, used by
a real task; its value appears in no log of any process, in no file of the agent, and nowhere in the
database but as ciphertext."""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, clean_environment, start_up
from tests.e2e.test_agent_crash import Demo, agent_argv
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

USE = "import hashlib, os; print(hashlib.sha256(os.environ['DEMO_SECRET'].encode()).hexdigest())"


def test_a_secret_reaches_its_task_and_no_log_file_or_table_shows_it(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    value = f"klq-e2e-{secrets.token_hex(16)}"
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    agent = None
    agent_log = tmp_path / "data" / "rack-agent.log"
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        argv = agent_argv(
            f"http://demo.localhost:{running.port}",
            demo.rack_pool_token(),
            "rack-1",
            tmp_path / "data" / "rack",
        )
        with agent_log.open("w") as log:
            agent = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        kept = demo.call(
            "POST",
            "/api/v1/secrets/",
            json={  # a tenant secret goes to the tasks of the groups it is granted to
                "scope": "tenant",
                "name": "DEMO_SECRET",
                "value": value,
                "audience": {"groups": ["research"]},
            },
        )
        assert "value" not in kept
        task = demo.call(
            "POST",
            "/api/v1/tasks/",
            json={
                "compute_resource": "Research: rack",
                "spec": {"command": [sys.executable, "-c", USE], "secrets": ["DEMO_SECRET"]},
            },
        )
        deadline = time.monotonic() + 120
        while demo.call("GET", f"/api/v1/tasks/{task['id']}/")["state"] != "completed":
            assert time.monotonic() < deadline, demo.call("GET", f"/api/v1/tasks/{task['id']}/")
            time.sleep(0.3)
        assert demo.logged(task["id"]) == [hashlib.sha256(value.encode()).hexdigest()]
        reads = demo.call("GET", "/api/v1/audit/", params={"action": "secret.read"})["results"]
        assert [(read["target"], read["on_behalf_of"]) for read in reads] == [
            ("secret tenant/DEMO_SECRET", "alice")
        ]
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        assert running.interrupt() == 0
    printed = running.everything()
    assert "POST /api/v1/secrets/ 201" in printed  # the request that carried it was logged, without it
    assert value not in printed  # web, worker, beat and the demo agent all print here
    for path in (tmp_path / "data").rglob("*"):
        if path.is_file() and "pg" not in path.parts:
            assert value.encode() not in path.read_bytes(), path
    dump = subprocess.run(["pg_dump", "--data-only", fresh_database], capture_output=True, check=True).stdout
    assert b"DEMO_SECRET" in dump  # the secret's row is there ...
    assert value.encode() not in dump  # ... and its value only as ciphertext
