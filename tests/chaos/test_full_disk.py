"""The plane's file store on a real filesystem that fills up (a tmpfs of 64 KiB) while a task's output
goes up: the web answers 507 with the cause, leaves no empty or half file, the agent retries, and once
the filesystem has room the output is stored whole."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.test_agent_away import state, wait
from tests.e2e.conftest import ROOT, clean_environment, start_up
from tests.e2e.test_agent_crash import Demo, agent_argv
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

SIZE = 200 * 1024
TASK = f"open('big.bin', 'wb').write(bytes(range(256)) * {SIZE // 256}); print('written', flush=True)"


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 64 KiB for the plane's files (mounting one needs root, as on the test machines)."""
    store = tmp_path / "store"
    store.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(store)],
        check=False,
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.strip()}")
    yield store
    subprocess.run(["umount", "-l", str(store)], check=False)


def files_in(folder: Path) -> list[str]:
    return sorted(
        str(Path(root, name).relative_to(folder)) for root, _, names in os.walk(folder) for name in names
    )


def test_a_full_store_refuses_an_output_in_words_and_stores_it_once_there_is_room(
    fresh_database: str, redis_url: str, small_store: Path, tmp_path: Path
) -> None:
    environment = clean_environment(
        DATABASE_URL=fresh_database, REDIS_URL=redis_url, KLIQUE_FILES_DIR=str(small_store)
    )
    running = start_up(environment, tmp_path / "data")
    agent = None
    agent_log = tmp_path / "agent.log"
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        argv = agent_argv(
            f"http://demo.localhost:{running.port}", demo.rack_pool_token(), "rack-disk", tmp_path / "agent"
        )
        with open(agent_log, "w") as log:
            agent = subprocess.Popen(
                [*argv, "--upload-patience", "120"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )
        spec = {"command": [sys.executable, "-c", TASK], "outputs": ["big.bin"]}
        task_id = demo.call(
            "POST", "/api/v1/tasks/", json={"compute_resource": "Research: rack", "spec": spec}
        )["id"]

        wait(
            "a refusal for a full store",
            lambda: "the plane's file store is full" in agent_log.read_text(),
            60,
        )
        assert "answered 507" in agent_log.read_text()
        assert files_in(small_store) == []  # no empty file, no half file, no temporary left behind
        assert state(demo, task_id)["state"] == "running"  # not completed while its output is not kept
        subprocess.run(["mount", "-o", "remount,size=4m", str(small_store)], check=True)

        final = wait("completed", lambda: (s := state(demo, task_id))["state"] == "completed" and s)
        assert final["reason_code"] != "outputs_not_stored", final
        (output,) = demo.call("GET", f"/api/v1/tasks/{task_id}/outputs/")
        expected = bytes(range(256)) * (SIZE // 256)
        assert (output["name"], output["size"], output["sha256"]) == (
            "big.bin",
            SIZE,
            hashlib.sha256(expected).hexdigest(),
        )
        stored = [name for name in files_in(small_store) if name.endswith("big.bin")]
        assert len(stored) == 1
        assert (small_store / stored[0]).read_bytes() == expected
    finally:
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait(timeout=30)
        assert running.interrupt() == 0
