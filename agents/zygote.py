"""Starts task runners by forking one process that has the runner's code loaded already.

    python -m agents.zygote      (started by the bare-metal backend; it speaks on its stdin and stdout)

A fresh interpreter for every task costs tens of milliseconds of CPU before the command even starts (the
interpreter, then the runner's imports); a fork of this process costs about one. Each request is one line
of JSON on stdin:

    {"cwd": ..., "env": {...}, "log": ..., "exit": ..., "spec": ..., "cache": ..., "command": [...],
     "variables": {...}, "record": ...}

and is answered with one line: the forked runner's pid, or `error <why>` when it could not be forked. The
pid is first appended to the run's `record` (agents.records), where the request names one. The
fork starts a session of its own (its pid is its process group, which the agent signals), takes `env` as
its whole environment and runs agents.runner.run: the same runner, with the same files, as `python -m
agents.runner`, so a task outlives its agent in the same way. The task's variables (secrets among them)
arrive through the pipe, in memory, and reach only the task's command.

This process stays single-threaded (a fork of a threaded process is unsafe) and reaps its children as
they end, so that an ended runner never lingers as a zombie that looks alive. It exits when its stdin
closes: when the agent that started it is gone. The runners it forked keep running then, reparented (each
is in a session of its own), and the next agent adopts them from its state or their records.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import Any, BinaryIO

from agents import runner
from protocol import environment as task_environment

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


def _reap(_signal: int, _frame: Any) -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _runner(request: dict[str, Any]) -> None:
    """In the fork: become the task's runner, and never return into the zygote's loop."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the runner waits for its own command
        # The signals a task is stopped or interrupted by reach its command as they would a fresh process,
        # even where the agent was started with them ignored (as a shell's background job is).
        for number in STOP_SIGNALS:
            signal.signal(number, signal.SIG_DFL)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for descriptor in (0, 1, 2):  # the zygote's pipes are the agent's, not the task's
            os.dup2(devnull, descriptor)
        os.close(devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({str(name): str(value) for name, value in request["env"].items()})
        runner.run(
            log_path=str(request["log"]),
            exit_path=str(request["exit"]),
            spec_path=request.get("spec"),
            cache=request.get("cache"),
            command=[str(word) for word in request["command"]],
            task_variables=task_environment.checked(request.get("variables") or {}),
        )
        code = 0
    finally:
        os._exit(code)  # no exit handlers, no flushing of buffers the fork shares with the zygote


def _note(record: object, pid: int) -> None:
    """The runner's pid, after the run's record (agents.records), before the agent hears of it: an agent
    killed before it committed the run finds the runner by it."""
    if isinstance(record, str):
        with contextlib.suppress(OSError), open(record, "ab") as handle:
            handle.write(f"{pid}\n".encode())


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    signal.signal(signal.SIGCHLD, _reap)  # the one handler the forks reset; the rest stay as Python set them
    for line in iter(requests.readline, b""):
        try:
            request = json.loads(line)
            pid = os.fork()
        except (ValueError, OSError) as error:
            replies.write(f"error {str(error)[:200]}\n".encode())
        else:
            if pid == 0:
                _runner(request)
            _note(request.get("record"), pid)
            replies.write(f"{pid}\n".encode())
        with contextlib.suppress(BrokenPipeError):
            replies.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
