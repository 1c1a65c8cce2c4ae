"""Runs one task so that it outlives its agent: environment build and output to a file, exit code to
a file.

    python -m agents.runner --log out.log --exit exit-code [--spec spec.json --cache DIR]
                            [--environment-on-stdin] -- program ...

The bare-metal agent has agents.zygote fork it (run() below) in a session of its own; the command line is
the same runner as a program of its own. The agent follows the files, so an agent that crashes and comes
back finds the task still running (or finished) and picks up where it stopped reading. The runner builds
the task's environment first (agents.environment), then runs the command. It ignores SIGTERM and SIGINT
once the command runs: those are for the command (the agent signals the whole process group); the runner
waits for it and writes its exit code (a negative number for a signal) last.

The task's own environment (its spec's variables and its secrets) comes as one JSON object on stdin (from
the zygote, in the fork's request), never in the runner's environment or on disk: only the task's command
gets it, not the runner, not the steps that build the task's environment (git, pip, the container engine's
pull).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

from agents.containers import ENGINE_CODES
from agents.environment import BUILD_FAILED, BuildFailed, build
from protocol import environment as task_environment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agents.runner")
    parser.add_argument("--log", required=True)
    parser.add_argument("--exit", required=True)
    parser.add_argument("--spec", help="the task's spec (JSON): how to build its environment")
    parser.add_argument("--cache", help="where environments are cached")
    parser.add_argument(
        "--environment-on-stdin", action="store_true", help="read the task's variables from stdin (JSON)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    task_variables = _task_variables(sys.stdin.buffer) if args.environment_on_stdin else {}
    run(
        log_path=args.log,
        exit_path=args.exit,
        spec_path=args.spec,
        cache=args.cache,
        command=command,
        task_variables=task_variables,
    )
    return 0


def run(
    *,
    log_path: str,
    exit_path: str,
    spec_path: str | None,
    cache: str | None,
    command: list[str],
    task_variables: dict[str, str],
) -> None:
    """Build the task's environment, run its command with its output appended to `log_path`, and write
    its exit code to `exit_path` last (whole or not at all). Used by main() and by agents.zygote's forks;
    the process's own environment is the base of the command's."""
    with open(log_path, "ab", buffering=0) as log:
        code, reason = _run(
            log_path=log_path, spec_path=spec_path, cache=cache, command=command, log=log,
            task_variables=task_variables,
        )  # fmt: skip
    if reason:  # before the exit code: whoever sees the code finds the reason already there
        _write_whole(reason_path(exit_path), reason)
    _write_whole(exit_path, str(code))


def reason_path(exit_path: str) -> str:
    """Where the runner says, in one line, why a task failed before or outside its own command (its
    environment could not be built, its program or image could not be started)."""
    return f"{exit_path}.reason"


def _write_whole(path: str, text: str) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)


def _task_variables(stream: BinaryIO) -> dict[str, str]:
    """The task's variables, checked again by the one rule (the agent checked them before sending)."""
    received = json.loads(stream.read() or b"{}")
    stream.close()
    return task_environment.checked(received)


def _run(
    *,
    log_path: str,
    spec_path: str | None,
    cache: str | None,
    command: list[str],
    log: BinaryIO,
    task_variables: dict[str, str],
) -> tuple[int, str]:
    folder = Path(log_path).parent
    spec = json.loads(Path(spec_path).read_text()) if spec_path else {}
    try:
        environment = build(spec, folder, Path(cache or folder / ".cache"), log, task_variables)
    except BuildFailed as failure:
        log.write(f"klique: the task's environment could not be built ({failure}); see above\n".encode())
        return BUILD_FAILED, f"Its environment could not be built: {failure}."
    try:
        child = subprocess.Popen(
            [*environment.prefix, *command],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=environment.cwd,
            env={**os.environ, **task_variables, **environment.env},
        )
    except OSError as error:
        program = environment.prefix[0] if environment.prefix else command[0] if command else "(nothing)"
        log.write(f"klique: cannot start {program}: {error.strerror}\n".encode())
        return 127, f"{program} could not be started: {error.strerror}."
    # Only now: the command keeps the default handlers; the runner outlasts it to record its end.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = child.wait()
    if environment.prefix and code in ENGINE_CODES:
        return code, ENGINE_CODES[code]
    return code, ""


if __name__ == "__main__":
    sys.exit(main())
