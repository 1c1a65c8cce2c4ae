"""Runs one task so that it outlives its agent: environment build and output to a file, exit code to
a file.

    python -m agents.runner --log out.log --exit exit-code [--spec spec.json --cache DIR] -- program ...

The agent starts this in a session of its own and follows the files, so an agent that crashes and comes
back finds the task still running (or finished) and picks up where it stopped reading. The runner builds
the task's environment first (agents.environment), then runs the command. It ignores SIGTERM and SIGINT
once the command runs: those are for the command (the agent signals the whole process group); the runner
waits for it and writes its exit code (a negative number for a signal) last.
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

from agents.environment import BUILD_FAILED, BuildFailed, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agents.runner")
    parser.add_argument("--log", required=True)
    parser.add_argument("--exit", required=True)
    parser.add_argument("--spec", help="the task's spec (JSON): how to build its environment")
    parser.add_argument("--cache", help="where environments are cached")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    with open(args.log, "ab", buffering=0) as log:
        code = _run(args, command, log)
    temporary = f"{args.exit}.tmp"
    with open(temporary, "w") as handle:
        handle.write(str(code))
    os.replace(temporary, args.exit)  # the exit code appears whole or not at all
    return 0


def _run(args: argparse.Namespace, command: list[str], log: BinaryIO) -> int:
    folder = Path(args.log).parent
    spec = json.loads(Path(args.spec).read_text()) if args.spec else {}
    try:
        environment = build(spec, folder, Path(args.cache or folder / ".cache"), log)
    except BuildFailed as failure:
        log.write(f"klique: the task's environment could not be built ({failure}); see above\n".encode())
        return BUILD_FAILED
    try:
        child = subprocess.Popen(
            [*environment.prefix, *command],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=environment.cwd,
            env={**os.environ, **environment.env},
        )
    except OSError as error:
        log.write(
            f"klique: cannot start {command[0] if command else '(nothing)'}: {error.strerror}\n".encode()
        )
        return 127
    # Only now: the command keeps the default handlers; the runner outlasts it to record its end.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
