"""The bare-metal backend: GPU choice, running a process group, its output and exit, and stopping it."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from agents.baremetal import UNITS_PER_GPU, BareMetal, Refused
from agents.main import Agent, Backoff, websocket_address


def assignment(task_id: str, units: int, command: list[str] | None) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "lease_id": "l",
        "size_units": units,
        "spec": {"command": command} if command else {},
    }


async def run_to_end(backend: BareMetal, task: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    reports: list[tuple[str, dict[str, Any]]] = []
    finished = asyncio.Event()

    async def report(kind: str, body: dict[str, Any]) -> None:
        reports.append((kind, body))
        if kind == "result":
            finished.set()

    await backend.start(task, report)
    await asyncio.wait_for(finished.wait(), timeout=30)
    return reports


def test_a_task_runs_on_its_gpus_and_reports_output_and_exit(tmp_path: Path) -> None:
    backend = BareMetal(4, tmp_path)
    script = "import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES']); print('done'); sys.exit(3)"
    reports = asyncio.run(
        run_to_end(backend, assignment("t1", 2 * UNITS_PER_GPU, [sys.executable, "-c", script]))
    )
    kinds = [kind for kind, _ in reports]
    assert (kinds[0], kinds[-1]) == ("status", "result")
    assert reports[0][1] == {"state": "running", "devices": [0, 1]}
    lines = [line for kind, body in reports if kind == "log" for line in body["lines"]]
    assert lines == ["0,1", "done"]
    assert reports[-1][1] == {"exit_code": 3, "stopped": False}
    assert backend.used == {0: 0, 1: 0}  # the devices are free again
    assert (tmp_path / "t1").is_dir()


def test_shares_go_on_one_device_and_whole_gpus_need_free_ones(tmp_path: Path) -> None:
    backend = BareMetal(2, tmp_path)
    assert backend._pick(UNITS_PER_GPU // 2) == [0]
    backend.used = {0: UNITS_PER_GPU // 2}
    assert backend._pick(UNITS_PER_GPU // 4) == [0]  # the fullest device that still fits
    assert backend._pick(UNITS_PER_GPU) == [1]
    with pytest.raises(Refused, match="2 free GPUs are needed and this host has 1"):
        backend._pick(2 * UNITS_PER_GPU)


def test_a_task_without_a_command_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        async def report(kind: str, body: dict[str, Any]) -> None:
            pass

        await BareMetal(1, tmp_path).start(assignment("t", UNITS_PER_GPU, None), report)

    with pytest.raises(Refused, match="no command"):
        asyncio.run(scenario())


def test_stop_sends_sigterm_then_sigkill_after_the_grace_period(tmp_path: Path) -> None:
    stubborn = "; ".join(
        [
            "import signal, time",
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
            "print('up', flush=True)",
            "time.sleep(60)",
        ]
    )

    async def scenario() -> tuple[list[tuple[str, dict[str, Any]]], float]:
        backend = BareMetal(1, tmp_path)
        reports: list[tuple[str, dict[str, Any]]] = []
        up, finished = asyncio.Event(), asyncio.Event()

        async def report(kind: str, body: dict[str, Any]) -> None:
            reports.append((kind, body))
            if kind == "log":
                up.set()
            if kind == "result":
                finished.set()

        await backend.start(assignment("t", UNITS_PER_GPU, [sys.executable, "-c", stubborn]), report)
        await asyncio.wait_for(up.wait(), timeout=30)
        started = asyncio.get_running_loop().time()
        await backend.stop("t", grace_seconds=0.5)
        await asyncio.wait_for(finished.wait(), timeout=30)
        return reports, asyncio.get_running_loop().time() - started

    reports, took = asyncio.run(scenario())
    assert reports[-1][1] == {"exit_code": -9, "stopped": True}  # it ignored SIGTERM, so SIGKILL
    assert 0.5 <= took < 10


def test_reports_stay_in_the_outbox_until_acknowledged(tmp_path: Path) -> None:
    agent = Agent(
        url="http://acme.localhost:8000", token="kqa_x_y", backend=BareMetal(1, tmp_path), agent_id="a"
    )

    async def scenario() -> None:
        await agent.report("t", "status", {"state": "running"})
        await agent.report("t", "log", {"stream": "stdout", "lines": ["hello"]})
        await agent._on_message({"type": "ack", "task_id": "t", "seq": 1})

    asyncio.run(scenario())
    assert list(agent.outbox) == [("t", 2)]  # replayed on the next connection
    assert agent.outbox[("t", 2)]["seq"] == 2


def test_addresses_and_backoff() -> None:
    assert websocket_address("http://demo.localhost:8000") == (
        "ws://demo.localhost:8000/agents/ws/",
        {},
        {"host": "127.0.0.1", "port": 8000},
    )
    assert websocket_address("https://acme.klique.example")[0] == "wss://acme.klique.example/agents/ws/"
    backoff = Backoff(base=1, cap=8)
    delays = [backoff.next() for _ in range(6)]
    assert all(0 <= delay <= 8 for delay in delays)
    backoff.reset()
    assert backoff.failures == 0
