"""Klique's node reporter: runs a task's command on a compute node and reports over HTTPS.

The batch script of an HPC task runs this once per node. It starts the command in its own process group,
copies its output to stdout (so the batch system's output file has it too) and posts it to the control
plane in batches with the task's own token, which is good for this task's current run only. Each report
is numbered per node, and the plane keeps each number once, so a retried post counts once. On the first
node it uploads the task's declared outputs when the command ends and writes the exit code beside them.
SIGTERM (a cancel or preemption through the batch system) is passed on to the command's process group.

Standard library only, and runnable as a plain script (`python3 node.py ...`), so any Python 3.9+ on a
compute node will do: compute nodes need outbound HTTPS to the plane, and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

FLUSH_SECONDS = 0.25
MAX_LINE = 64 * 1024
RANK_VARIABLES = ("SLURM_NODEID", "PBS_NODENUM", "OMPI_COMM_WORLD_NODE_RANK")


def address(url: str) -> tuple[str, dict[str, str]]:
    """The base URL to connect to and extra headers: a *.localhost name connects to 127.0.0.1 and names
    the tenant in Host (RFC 6761), as the agent does."""
    parts = urlsplit(url.rstrip("/"))
    host = parts.hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit((parts.scheme, f"127.0.0.1{port}", "", "", "")), {"Host": parts.netloc}
    return urlunsplit((parts.scheme, parts.netloc, "", "", "")), {}


class Reporter:
    def __init__(self, url: str, task_id: str, token: str, source: str) -> None:
        self.base, self.headers = address(url)
        self.task_id, self.token, self.source = task_id, token, source
        self.pending: list[dict[str, object]] = []
        self.seq = 0
        self.lock = threading.Lock()

    def add(self, kind: str, body: dict[str, object]) -> None:
        with self.lock:
            self.seq += 1
            self.pending.append({"type": kind, "source": self.source, "seq": self.seq, **body})

    def _request(self, method: str, path: str, data: bytes, content_type: str) -> None:
        request = urllib.request.Request(  # noqa: S310 -- the plane's http(s) URL, from the agent
            self.base + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type, **self.headers},
        )
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 -- the plane's http(s) URL
            response.read()

    def flush(self) -> bool:
        """Post what is pending; True when nothing is left."""
        with self.lock:
            batch = list(self.pending)
        if not batch:
            return True
        try:
            self._request(
                "POST",
                f"/agents/v1/tasks/{self.task_id}/reports/",
                json.dumps({"reports": batch}).encode(),
                "application/json",
            )
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            if error.code in (400, 401, 403, 404):  # refused for good: say so once and drop it
                print(
                    f"klique: the plane refused this task's reports ({error.code}): {detail}", file=sys.stderr
                )
                with self.lock:
                    del self.pending[: len(batch)]
                return True
            return False
        except OSError:
            return False
        with self.lock:
            del self.pending[: len(batch)]
        return not self.pending

    def upload(self, name: str, path: Path) -> str | None:
        try:
            self._request(
                "PUT",
                f"/agents/v1/tasks/{self.task_id}/outputs/{quote(name)}",
                path.read_bytes(),
                "application/octet-stream",
            )
        except (OSError, urllib.error.HTTPError) as error:
            return f"klique: output {name} was not uploaded: {error}"
        return None


def pieces(line: str) -> list[str]:
    return [line[start : start + MAX_LINE] for start in range(0, max(len(line), 1), MAX_LINE)]


def run(arguments: argparse.Namespace) -> int:
    rank = next((int(os.environ[name]) for name in RANK_VARIABLES if os.environ.get(name, "").isdigit()), 0)
    token = Path(arguments.token_file).read_text().strip()
    reporter = Reporter(arguments.url, arguments.task, token, f"node-{rank}")
    workdir = Path(arguments.workdir)
    child = subprocess.Popen(
        arguments.command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=arguments.chdir or workdir,
    )

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    if rank == 0:
        reporter.add("status", {"state": "running", "host": os.uname().nodename})

    buffered: list[str] = []
    lock = threading.Lock()

    def read() -> None:
        assert child.stdout is not None
        for raw in child.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            sys.stdout.write(line + "\n")
            with lock:
                buffered.extend(pieces(line))
        sys.stdout.flush()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    failures = 0
    while reader.is_alive():
        reader.join(FLUSH_SECONDS if failures == 0 else min(30.0, FLUSH_SECONDS * 2**failures))
        with lock:
            lines, buffered[:] = list(buffered), []
        if lines:
            reporter.add("log", {"stream": "stdout", "lines": lines})
        failures = 0 if reporter.flush() else failures + 1
    code = child.wait()
    code = code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
    if rank == 0:
        folder = workdir.resolve()
        for name in sorted(
            {
                str(Path(path).resolve().relative_to(folder))
                for pattern in arguments.output
                for path in glob.glob(str(folder / pattern), recursive=True)
                if Path(path).is_file() and Path(path).resolve().is_relative_to(folder)
            }
        ):
            problem = reporter.upload(name, folder / name)
            if problem:
                reporter.add("log", {"stream": "klique", "lines": [problem]})
        (workdir / "exit-code").write_text(str(code))
    deadline = time.monotonic() + arguments.final_seconds
    while not reporter.flush() and time.monotonic() < deadline:
        time.sleep(1)
    if reporter.pending:
        print(f"klique: {len(reporter.pending)} reports could not reach {arguments.url}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="klique-node", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the tenant's address")
    parser.add_argument("--task", required=True)
    parser.add_argument("--token-file", required=True, help="holds the task's token (mode 600)")
    parser.add_argument("--workdir", required=True, help="the task's folder: outputs and exit code")
    parser.add_argument("--chdir", help="run the command here instead of the task's folder")
    parser.add_argument("--output", action="append", default=[], help="a file pattern to upload at the end")
    parser.add_argument("--final-seconds", type=float, default=60.0, help="keep trying the last reports")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    arguments = parser.parse_args(argv)
    if arguments.command[:1] == ["--"]:
        arguments.command = arguments.command[1:]
    if not arguments.command:
        parser.error("give the command after --")
    return run(arguments)


if __name__ == "__main__":
    sys.exit(main())
