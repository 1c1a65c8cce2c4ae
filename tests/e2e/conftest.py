"""Real Klique processes for end-to-end tests: `klique up` as a subprocess, read like a person would."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from klique.embedded import LOCAL_POSTGRES, LOCAL_REDIS, port_open

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def clean_environment(**overrides: str) -> dict[str, str]:
    """The environment of a `klique up` under test. The demo's cloud pool (moto, its autoscaler, its local
    instances) runs only where a test asks for it (KLIQUE_DEMO_CLOUD="1": the demo's own tests): the others
    test their own faults, on a machine not busy with the demo's cloud."""
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "KLIQUE_DATA_DIR"}
    }
    environment["KLIQUE_DEMO_CLOUD"] = "0"
    environment.update(overrides)
    environment["PYTHONUNBUFFERED"] = "1"
    return environment


@dataclass
class Running:
    """A `klique up` process and what it printed."""

    process: subprocess.Popen[str]
    port: int
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue[str] = field(default_factory=queue.Queue)

    def start_reader(self) -> None:
        def pump() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self._queue.put(line)

        threading.Thread(target=pump, daemon=True).start()

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match
        tail = "".join(self.lines[-40:])
        raise AssertionError(f"`klique up` never printed {pattern!r}; it printed:\n{tail}")

    def printed(self, pattern: str) -> re.Match[str]:
        """The first line read so far (by wait_for) that matches: a line printed before the one waited for."""
        for line in self.lines:
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"`klique up` did not print {pattern!r} before:\n{''.join(self.lines[-40:])}")

    def everything(self) -> str:
        """All it printed, once it has exited: what was read so far and the rest."""
        assert self.process.poll() is not None, "still running"
        time.sleep(0.5)  # the reader reaches the end of the pipe
        while not self._queue.empty():
            self.lines.append(self._queue.get_nowait())
        return "".join(self.lines)

    def interrupt(self, timeout: float = 60) -> int:
        """Ctrl-C, as a person at the terminal would; returns the exit code."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def start_up(environment: dict[str, str], data_dir: Path) -> Running:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "klique.cli",
            "up",
            "--demo",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--concurrency",
            "1",
        ],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    running = Running(process=process, port=port)
    running.start_reader()
    return running


@pytest.fixture
def fresh_database() -> Iterator[str]:
    """An empty database on the machine's PostgreSQL, dropped afterwards."""
    if not port_open(*LOCAL_POSTGRES):
        pytest.skip("no PostgreSQL on 127.0.0.1:5432; the embedded variant of this test still runs")
    name = f"klique_e2e_{uuid.uuid4().hex[:8]}"
    admin_url = f"postgresql://postgres@{LOCAL_POSTGRES[0]}:{LOCAL_POSTGRES[1]}/postgres"
    with psycopg.connect(admin_url, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    yield f"postgres://postgres@{LOCAL_POSTGRES[0]}:{LOCAL_POSTGRES[1]}/{name}"
    with psycopg.connect(admin_url, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def redis_url() -> str:
    if not port_open(*LOCAL_REDIS):
        pytest.skip("no Redis on 127.0.0.1:6379; the embedded variant of this test still runs")
    return f"redis://{LOCAL_REDIS[0]}:{LOCAL_REDIS[1]}/10"


@dataclass
class RackDemo:
    """`klique up --demo` with a bare-metal pool "rack" (compute resource "Research: rack") and its agent."""

    running: Running
    demo: Any  # tests.e2e.test_agent_crash.Demo: the demo tenant's API, as its admin
    argv: list[str]
    folder: Path
    agent: subprocess.Popen[bytes] | None = None
    environment: dict[str, str] = field(default_factory=dict)  # the plane's, for commands beside it

    def start_agent(self, log: str = "agent.log") -> None:
        with (self.folder / log).open("w") as output:
            self.agent = subprocess.Popen(self.argv, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)

    def stop_agent(self) -> None:
        if self.agent is not None:
            self.agent.terminate()
            self.agent.wait(timeout=90)  # its apps' own shutdown within the agent's grace period


@pytest.fixture
def rack_demo(fresh_database: str, redis_url: str, tmp_path: Path) -> Iterator[RackDemo]:
    from tests.e2e.test_agent_crash import Demo, agent_argv
    from tests.e2e.test_up import BANNER_CURL

    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    rack = None
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        url, folder = f"http://demo.localhost:{running.port}", tmp_path / "data" / "rack"
        rack = RackDemo(running, demo, agent_argv(url, demo.rack_pool_token(), "rack-1", folder), tmp_path)
        rack.environment = environment
        rack.start_agent()
        yield rack
    finally:
        if rack is not None:
            rack.stop_agent()
        assert running.interrupt() == 0


@pytest.fixture
def chromium() -> Iterator[Any]:
    """Debian's Chromium under Playwright, as the portal's tests drive it."""
    from tests.portal.conftest import chromium_launched

    with chromium_launched() as launched:
        yield launched


def installed(script: str) -> str:
    """An app's program installed on this host by the project's own script (deploy/apps/SCRIPT.sh, into
    ROOT/.tools/SCRIPT): the path it prints."""
    made = subprocess.run(
        [str(ROOT / "deploy" / "apps" / f"{script}.sh"), str(ROOT / ".tools" / script)],
        check=True,
        capture_output=True,
        text=True,
    )
    return made.stdout.strip().splitlines()[-1]


def signed_in(chromium: Any, running: Running) -> tuple[Any, str]:
    """A page of a new browser context signed in to the portal as the demo's admin (the password `klique
    up` printed), on the portal's apps; and the portal's address."""
    signed = running.printed(r"Portal:\s+(\S+)/portal/\s+\(sign in: (\S+) / (\S+)\)")
    portal, username, password = signed[1], signed[2], signed[3]
    page = chromium.new_context().new_page()
    page.goto(f"{portal}/portal/sign-in/?next=/portal/apps/")
    page.fill("#username", username)
    page.fill("#password", password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{portal}/portal/apps/")
    return page, portal
