"""The cluster's commands at an agent's shutdown: let finish a moment, then reaped before the loop closes.

A command still running when the agent's loop closed (a `squeue` of the poller, an `sbatch`) used to be
collected afterwards: its transport, closing, called into the closed loop ("Event loop is closed")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

STOPPING_AGENT = textwrap.dedent(
    """
    import asyncio, gc, sys, time
    from agents.hpc.cluster import execute

    held = []  # as the backend holds its poller's task: the task outlives the loop

    async def main():
        held.append(asyncio.get_running_loop().create_task(execute(sys.argv[1:])))
        await asyncio.sleep(0.3)  # the agent's run ends with the command in flight

    asyncio.run(main())
    time.sleep(1)  # the command ends after the loop has closed
    held.clear()
    gc.collect()
    """
)


def _stop_during(*argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    ended = subprocess.run(
        [sys.executable, "-X", "dev", "-c", STOPPING_AGENT, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return ended, time.monotonic() - started


@pytest.mark.parametrize(
    "argv",
    [
        ("sleep", "0.6"),  # a command that ends just after the loop would have closed
        ("sleep", "30"),  # one that would outlast any patience: killed
        ("sh", "-c", "trap '' TERM; sleep 30"),  # one that ignores SIGTERM, its child holding its pipes
        ("sh", "-c", "yes | head -c 10000000"),  # one whose output fills its pipe
    ],
    ids=["ending-soon", "sleeping", "lingering-child", "full-pipe"],
)
def test_a_command_in_flight_is_reaped_before_the_loop_closes(argv: tuple[str, ...]) -> None:
    ended, took = _stop_during(*argv)
    assert ended.returncode == 0, ended.stderr
    for said in ("Exception ignored", "Event loop is closed", "unclosed transport", "is still running"):
        assert said not in ended.stderr, ended.stderr
    assert took < 20, f"the shutdown waited {took:.1f} s for the command"


def test_a_command_already_sent_is_let_finish(tmp_path: Path) -> None:
    mark = tmp_path / "submitted"
    ended, _ = _stop_during("sh", "-c", f"sleep 1; echo 42 > {mark}")
    assert ended.returncode == 0, ended.stderr
    assert mark.read_text() == "42\n", "a submission in flight was cut off by the shutdown"
    assert "Exception ignored" not in ended.stderr, ended.stderr
