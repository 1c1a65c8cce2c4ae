"""A real web process (uvicorn) on the test database, for the tests that measure it from outside."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import free_port
from tests.gateway.conftest import start_web, wait_until_listening
from tests.world import World


@pytest.fixture(scope="module")
def served(world: World) -> Iterator[tuple[str, int]]:
    """The web process's address and its pid."""
    port = free_port()
    process = start_web(port)
    try:
        wait_until_listening(port, process)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(timeout=20)


def memory_mb(pid: int, field: str) -> float:
    """A process's memory figure from /proc (VmRSS now, VmHWM its peak), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")
