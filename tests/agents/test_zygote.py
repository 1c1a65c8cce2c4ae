"""agents.zygote: the runners it forks behave as `python -m agents.runner` did, outlive it, never linger as
zombies, and a zygote that died is replaced."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from agents.baremetal import BareMetal, Starter, _alive
from agents.state import Position, State
from agents.zygote import STOP_SIGNALS


def request(folder: Path, command: list[str], **extra: Any) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "cwd": str(folder),
        "env": {"PATH": os.environ["PATH"], "KLIQUE_TASK_ID": folder.name},
        "log": str(folder / "output.log"),
        "exit": str(folder / "exit-code"),
        "spec": None,
        "cache": str(folder / ".cache"),
        "command": command,
        "variables": {},
        **extra,
    }


def wait_for(predicate: Any, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_forked_runner_runs_the_command_with_its_environment_and_writes_its_exit_code(
    tmp_path: Path,
) -> None:
    """The base environment is the request's whole environment; the task's variables reach only the command;
    the signals that stop a task are not ignored by it, even where the agent ignores them (as a shell's
    background job does); its folder is its working directory."""
    script = (
        "import os; print(os.environ['KLIQUE_TASK_ID'], os.environ['EPOCHS'], os.getcwd());"
        "print('KLIQUE_AGENT_ONLY' in os.environ);"
        "raise SystemExit(7)"
    )
    # The shell says which signals it started with ignored, then becomes the Python script.
    shell = ["sh", "-c", 'grep ^SigIgn: /proc/$$/status | cut -f2; exec "$0" -c "$1"']
    os.environ["KLIQUE_AGENT_ONLY"] = "1"
    ignoring = {number: signal.signal(number, signal.SIG_IGN) for number in STOP_SIGNALS}
    try:

        async def scenario() -> int:
            starter = Starter()
            pid = await starter.start(
                request(tmp_path / "t1", [*shell, sys.executable, script], variables={"EPOCHS": "3"})
            )
            starter.close()
            return pid

        pid = asyncio.run(scenario())
    finally:
        del os.environ["KLIQUE_AGENT_ONLY"]
        for number, handler in ignoring.items():
            signal.signal(number, handler)
    wait_for((tmp_path / "t1" / "exit-code").exists)
    assert (tmp_path / "t1" / "exit-code").read_text() == "7"
    ignored, first, inherited = (tmp_path / "t1" / "output.log").read_text().split("\n")[:3]
    assert first == f"t1 3 {tmp_path / 't1'}"
    assert inherited == "False"  # the agent's own variables are not the task's
    for number in STOP_SIGNALS:  # the agent (this test) ignored them; the command does not
        assert not int(ignored, 16) & (1 << (number - 1)), signal.Signals(number).name
    assert os.getpgid(pid) == pid  # a session and process group of its own: the agent signals the group


def test_runners_outlive_the_zygote_and_ended_ones_are_reaped(tmp_path: Path) -> None:
    """Closing the zygote (the agent gone) leaves a running runner running to its end; a runner killed
    before it could write its exit code is gone at once (reaped), so the agent reports it killed."""
    marker = tmp_path / "go"

    async def scenario() -> tuple[int, int, int]:
        starter = Starter()
        waits = await starter.start(
            request(
                tmp_path / "waits", ["sh", "-c", f"while [ ! -e {marker} ]; do sleep 0.05; done; echo done"]
            )
        )
        killed = await starter.start(request(tmp_path / "killed", ["sleep", "60"]))
        assert starter.process is not None
        zygote = starter.process.pid
        os.kill(killed, signal.SIGKILL)  # the runner itself, before its command ends
        for _ in range(100):
            if not _alive(killed):
                break
            await asyncio.sleep(0.05)
        starter.close()
        await asyncio.sleep(0.2)
        return waits, killed, zygote

    waits, killed, zygote = asyncio.run(scenario())
    assert not _alive(killed)  # not a zombie that answers signal 0
    assert not (tmp_path / "killed" / "exit-code").exists()
    wait_for(lambda: not _alive(zygote))  # its stdin closed: the zygote left
    assert _alive(waits)
    marker.touch()
    wait_for((tmp_path / "waits" / "exit-code").exists)
    assert (tmp_path / "waits" / "exit-code").read_text() == "0"
    assert (tmp_path / "waits" / "output.log").read_text() == "done\n"


def test_a_zygote_that_died_is_replaced_and_the_task_still_starts(tmp_path: Path) -> None:
    bare = BareMetal(1, tmp_path / "work", State(tmp_path / "agent.sqlite"))
    reports: list[tuple[str, dict[str, Any]]] = []

    async def scenario() -> list[int]:
        done = asyncio.Event()

        async def report(task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
            bare.state.enqueue(task_id, kind, body, offset=offset)
            reports.append((kind, body))
            if kind == "result":
                done.set()

        zygotes = []
        for index in range(2):
            if bare.starter.process is not None:
                os.kill(bare.starter.process.pid, signal.SIGKILL)
                bare.starter.process.wait()
            done.clear()
            task = {"task_id": f"t{index}", "lease_id": "l", "size_units": 100, "spec": {"command": ["true"]}}
            await bare.start(task, report)
            await asyncio.wait_for(done.wait(), timeout=30)
            assert bare.starter.process is not None
            zygotes.append(bare.starter.process.pid)
        bare.starter.close()
        return zygotes

    first, second = asyncio.run(scenario())
    assert first != second  # the second task was forked by a new zygote
    results = [body for kind, body in reports if kind == "result"]
    assert [result["exit_code"] for result in results] == [0, 0]
