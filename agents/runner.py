"""Runs one task's command so that it outlives its agent: output to a file, exit code to a file.

    python -m agents.runner --log out.log --exit exit-code -- program arguments...

The agent starts this in a session of its own and follows the files, so an agent that crashes and comes
back finds the task still running (or finished) and picks up where it stopped reading. The runner itself
ignores SIGTERM and SIGINT: those are for the command (the agent signals the whole process group); the
runner waits for the command and writes its exit code (a negative number for a signal) last.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agents.runner")
    parser.add_argument("--log", required=True)
    parser.add_argument("--exit", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    with open(args.log, "ab", buffering=0) as log:
        try:
            child = subprocess.Popen(  # noqa: S603 -- the task's own command, as a list, never a shell string
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
            # Only now: the command keeps the default handlers; the runner outlasts it to record its end.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            code = child.wait()
        except OSError as error:
            log.write(
                f"klique: cannot start {command[0] if command else '(nothing)'}: {error.strerror}\n".encode()
            )
            code = 127
    temporary = f"{args.exit}.tmp"
    with open(temporary, "w") as handle:
        handle.write(str(code))
    os.replace(temporary, args.exit)  # the exit code appears whole or not at all
    return 0


if __name__ == "__main__":
    sys.exit(main())
