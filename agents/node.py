"""Klique's node reporter: runs a task's command on a compute node and reports over HTTPS.

The batch script of an HPC task runs this once per node. It starts the command in its own process group,
copies its output to stdout (so the batch system's output file has it too) and posts it to the control
plane in batches with the task's own token, which is good for this task's current run only. Each report
is numbered per node, and the plane keeps each number once, so a retried post counts once. Metrics go the
same way: JSON objects the task appends, one per line, to $KLIQUE_METRICS_FILE, and, where nvidia-smi
answers, the node's GPU utilization and memory every --metrics-seconds. On the first node it uploads the
task's declared outputs when the command ends and writes the exit code beside them.
SIGTERM (a cancel or preemption through the batch system) is passed on to the command's process group.
An app from the catalogue (--app-port) is started on a port of this node's loopback, behind a relay that
lets in only the agent, which holds the run's key (AppRelay; agents.relay is the agent's side).
`klique-node relay` runs such a relay alone, beside an app another process serves: a Kubernetes pod's
sidecar (protocol.pods), with the key in $KLIQUE_APP_KEY.

Standard library only, and runnable as a plain script (`python3 node.py ...`), so any Python 3.9+ on a
compute node will do: compute nodes need outbound HTTPS to the plane, and nothing else (an app's relay
also takes connections from the login node).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import hmac
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

JSON = "application/json"
FLUSH_SECONDS = 0.25
MAX_LINE = 64 * 1024
RANK_VARIABLES = ("SLURM_NODEID", "PBS_NODENUM", "OMPI_COMM_WORLD_NODE_RANK")
UPLOAD_PATIENCE_SECONDS = 300.0  # how long an output upload is retried while the plane cannot take it
# Answers that mean "not now": the plane down or restarting, its store full or not writable, a checksum
# that did not match what arrived. Anything else is final.
RETRIED_STATUSES = frozenset({408, 422, 425, 429, 500, 502, 503, 504, 507})
# An app's relay (AppRelay): the words the agent opens with, and the relay's answer (agents.relay).
APP_HELLO = b"KLIQUE-APP/1 "
APP_ANSWER = b"KLIQUE-APP/1 OK\n"
APP_ADDRESS_FILE = "app-address"  # in the task's folder: the relay's and the app's ports
APP_HANDSHAKE_SECONDS = 10.0
APP_LOOK_SECONDS = 1.0  # how often the reporter looks whether its app listens yet
APP_KEY_VARIABLE = "KLIQUE_APP_KEY"  # `klique-node relay`'s key, from the pod's own Secret
APP_HANDSHAKES = 32  # callers a relay waits on at once for the key; more are turned away


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

    def _request(
        self, method: str, path: str, data: Any, content_type: str, extra: dict[str, str] | None = None
    ) -> bytes:
        request = urllib.request.Request(  # noqa: S310 -- the plane's http(s) URL, from the agent
            self.base + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": content_type,
                **self.headers,
                **(extra or {}),
            },
        )
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 -- the plane's http(s) URL
            return bytes(response.read())

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

    def upload(self, name: str, path: Path, patience: float = UPLOAD_PATIENCE_SECONDS) -> str | None:
        """Store one output where the task's project keeps them (the plane's file store, or its bucket
        through a presigned URL, as the plane's ticket says), streamed from disk with its SHA-256; retried
        from a new ticket with backoff while it cannot be stored now, for up to `patience` seconds. None
        when stored, else what went wrong, in words."""
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1024 * 1024):
                digest.update(chunk)
        claim = {"sha256": digest.hexdigest(), "size": path.stat().st_size}
        deadline, delay = time.monotonic() + patience, 0.5
        while True:
            try:
                problem = self._store(quote(name), path, claim)
                if problem is None:
                    return None
            except Refused as refused:
                return f"klique: output {name} was not stored: {refused}"
            except urllib.error.HTTPError as error:
                problem = f"the plane answered {error.code}: {_detail(error)}"
                if error.code not in RETRIED_STATUSES:
                    return f"klique: output {name} was not stored: {problem}"
            except OSError as error:
                problem = f"the plane cannot be reached ({error})"
            if time.monotonic() > deadline:
                return f"klique: output {name} was not stored: {problem}; gave up after {patience:.0f} s"
            time.sleep(random.uniform(0, delay))  # noqa: S311 -- jitter, not secrecy
            delay = min(15.0, delay * 2)

    def _store(self, quoted: str, path: Path, claim: dict[str, Any]) -> str | None:
        """One try (the plane's protocol/outputs.py): None when stored, else what to retry on."""
        body = json.dumps(claim).encode()
        try:
            ticket = json.loads(
                self._request("POST", f"/agents/v1/tasks/{self.task_id}/output-tickets/{quoted}", body, JSON)
            )
        except urllib.error.HTTPError as error:
            if error.code != 404:  # 404: a plane older than tickets, with its file store only
                raise
            ticket = {"store": "plane"}
        if not isinstance(ticket, dict) or ticket.get("store") not in ("plane", "s3"):
            raise Refused(f"the plane's ticket cannot be read: {str(ticket)[:200]}")
        if ticket["store"] == "plane":
            with open(path, "rb") as handle:
                self._request(
                    "PUT",
                    f"/agents/v1/tasks/{self.task_id}/outputs/{quoted}",
                    handle,
                    "application/octet-stream",
                    {"Content-Length": str(claim["size"]), "X-Klique-Sha256": claim["sha256"]},
                )
            return None
        problem = _put_in_bucket(ticket, path, claim["size"])
        if problem:
            return problem
        self._request("POST", f"/agents/v1/tasks/{self.task_id}/output-receipts/{quoted}", body, JSON)
        return None


class Refused(Exception):
    """What will never work; the message says why."""


def _put_in_bucket(ticket: dict[str, Any], path: Path, size: int) -> str | None:
    """PUT the file to the ticket's presigned URL with exactly its signed headers and none of the plane's
    (urllib follows no redirect of a PUT); None when stored, else what the bucket said."""
    url, headers = ticket.get("url"), ticket.get("headers", {})
    if (
        not isinstance(url, str)
        or urlsplit(url).scheme not in ("http", "https")
        or not isinstance(headers, dict)
    ):
        raise Refused("the plane's ticket carries no http(s) URL to store the file at")
    try:
        with open(path, "rb") as handle:
            request = urllib.request.Request(  # noqa: S310 -- an http(s) URL the plane signed
                url, data=handle, method="PUT", headers={**headers, "Content-Length": str(size)}
            )
            with urllib.request.urlopen(request, timeout=300) as response:  # noqa: S310 -- checked above
                response.read()
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")
        said = " ".join(re.findall(r"<(?:Code|Message)>([^<]*)<", text)) or str(error.reason)
        return f"the bucket answered {error.code}: {said[:300]}"
    except OSError as error:
        return f"the bucket cannot be reached ({error})"
    return None


def _detail(error: urllib.error.HTTPError) -> str:
    """The plane's JSON detail, or the start of whatever else it answered (a proxy's HTML page)."""
    text = error.read().decode(errors="replace")
    try:
        detail = json.loads(text).get("detail")
    except (ValueError, AttributeError):
        detail = None
    return detail if isinstance(detail, str) and detail else " ".join(text.split())[:200] or str(error.reason)


class Metrics:
    """The task's own metrics (new JSON lines in its metrics file) and samples of the node's GPUs."""

    def __init__(self, path: Path, every: float) -> None:
        self.path, self.every, self.offset, self.due = path, every, 0, 0.0

    def from_task(self) -> tuple[list[dict[str, object]], list[str]]:
        """New metric objects, and a sentence for each line that is not one."""
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return [], []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        values, problems = [], []
        for line in complete.decode(errors="replace").splitlines():
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                values.append(value)
            elif line.strip():
                problems.append(f"klique: not a JSON object in {self.path.name}, skipped: {line[:200]}")
        return values, problems

    def from_gpus(self) -> dict[str, object] | None:
        """Utilization and memory of the node's GPUs, every `every` seconds where nvidia-smi answers."""
        if self.every <= 0 or time.monotonic() < self.due or shutil.which("nvidia-smi") is None:
            return None
        self.due = time.monotonic() + self.every
        query = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total"]
        query.append("--format=csv,noheader,nounits")
        try:
            answer = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        gpus = []
        for line in answer.stdout.splitlines():
            fields = [field.strip() for field in line.split(",")]
            if len(fields) == 4 and all(field.replace(".", "", 1).isdigit() for field in fields):
                index, utilization, used, total = fields
                gpus.append(
                    {
                        "index": int(index),
                        "utilization_percent": float(utilization),
                        "memory_used_mib": float(used),
                        "memory_total_mib": float(total),
                    }
                )
        return {"gpus": gpus} if gpus else None


def pieces(line: str) -> list[str]:
    return [line[start : start + MAX_LINE] for start in range(0, max(len(line), 1), MAX_LINE)]


def collect(reporter: Reporter, buffered: list[str], lock: threading.Lock, metrics: Metrics) -> None:
    """Queue the output read since the last call and any new metrics."""
    with lock:
        lines, buffered[:] = list(buffered), []
    if lines:
        reporter.add("log", {"stream": "stdout", "lines": lines})
    values, problems = metrics.from_task()
    for value in values:
        reporter.add("metric", {"values": value})
    if problems:
        reporter.add("log", {"stream": "klique", "lines": problems})
    sample = metrics.from_gpus()
    if sample is not None:
        reporter.add("metric", {"values": sample})


def upload_outputs(reporter: Reporter, folder: Path, patterns: list[str]) -> None:
    """Upload the files inside the task's folder that match its declared patterns; say what failed."""
    for name in sorted(
        {
            str(Path(path).resolve().relative_to(folder))
            for pattern in patterns
            for path in glob.glob(str(folder / pattern), recursive=True)
            if Path(path).is_file() and Path(path).resolve().is_relative_to(folder)
        }
    ):
        problem = reporter.upload(name, folder / name)
        if problem:
            reporter.add("log", {"stream": "klique", "lines": [problem]})


class AppRelay:
    """An app's way in from the agent on the login node: a port on this node's network that leads to the
    app (on this node's loopback) only for a caller who first sends HELLO with the run's key; anyone else
    is disconnected having reached nothing (agents.relay is the agent's side)."""

    def __init__(self, key: str, app_port: int, port: int = 0) -> None:
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError("the app key file does not hold a key")
        self.expected, self.app_port = APP_HELLO + key.encode() + b"\n", app_port
        if socket.has_dualstack_ipv6():
            self.server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self.server = socket.create_server(("", port))
        self.port = int(self.server.getsockname()[1])
        self.greeting = threading.BoundedSemaphore(APP_HANDSHAKES)  # callers not yet known to hold the key

    def serve_forever(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return  # closed
            if not self.greeting.acquire(blocking=False):
                connection.close()  # a flood of callers who say nothing holds no more threads
                continue
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _greeted(self, connection: socket.socket) -> bool:
        """Whether the caller opened with the run's key, within the time it has."""
        try:
            connection.settimeout(APP_HANDSHAKE_SECONDS)
            received = b""
            while len(received) < len(self.expected):
                chunk = connection.recv(len(self.expected) - len(received))
                if not chunk:
                    return False
                received += chunk
            return hmac.compare_digest(received, self.expected)
        except OSError:
            return False
        finally:
            self.greeting.release()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            if not self._greeted(connection):
                return
            try:
                app = socket.create_connection(("127.0.0.1", self.app_port), timeout=APP_HANDSHAKE_SECONDS)
            except OSError:
                return
            with app:
                for end in (connection, app):  # bytes go on as they come: no Nagle delay on either side
                    end.settimeout(None)
                    end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connection.sendall(APP_ANSWER)
                back = threading.Thread(target=_copy, args=(app, connection), daemon=True)
                back.start()
                _copy(connection, app)
                back.join()


def _copy(source: socket.socket, sink: socket.socket) -> None:
    """Bytes from one end to the other until the first says it is done (or either breaks)."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)
            source.shutdown(socket.SHUT_RDWR)


def listeners(port: int, group: int = 0) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses on which something on this host listens on `port` (its /proc/net/tcp and tcp6): a
    process of process group `group` where one is given, else anything."""
    owned = _sockets_of(group) if group else None
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 4 or fields[3] != "0A":  # LISTEN
                continue
            local, _, hex_port = fields[1].partition(":")
            if not hex_port or int(hex_port, 16) != port:
                continue
            if owned is not None and (len(fields) < 10 or fields[9] not in owned):
                continue
            raw = bytes.fromhex(local)  # each 32-bit word in the host's (little-endian) order
            raw = b"".join(raw[at : at + 4][::-1] for at in range(0, len(raw), 4))
            found.append(ipaddress.ip_address(socket.inet_ntop(family, raw)))
    return found


def _sockets_of(group: int) -> set[str]:
    """The inodes of the sockets the processes of a process group hold (those this user may read)."""
    inodes = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != group:
                continue
            for descriptor in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(descriptor)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    return inodes


def exposed(port: int, group: int = 0) -> list[str]:
    """The addresses beyond the loopback on which something (of process group `group`, where given)
    listens on `port`: an app there is reached past its relay and its route."""
    return _beyond(listeners(port, group), port)


def _beyond(addresses: list[ipaddress.IPv4Address | ipaddress.IPv6Address], port: int) -> list[str]:
    found = []
    for address in addresses:
        mapped = getattr(address, "ipv4_mapped", None)
        if not (address.is_loopback or (mapped is not None and mapped.is_loopback)):
            found.append(f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}")
    return found


def exposure(port: int, group: int = 0) -> str:
    """Why an app on `port` is reachable past its route ("" where it listens on the loopback only): what
    its process group `group` listens on where the group holds the port, else (no group, or an app in a
    container, whose processes are the engine's) whatever listens there."""
    held = listeners(port, group) if group else []
    found = _beyond(held or listeners(port), port)
    if not found:
        return ""
    return (
        f"the app listens on {', '.join(sorted(set(found)))}, where anyone who reaches this host's network "
        "reaches it past its route and its sharing; its entry must bind it to 127.0.0.1 (as the shipped "
        "entries do)"
    )


def guard_app(child: subprocess.Popen[bytes], port: int) -> None:
    """Once the app listens on its port, stop it (saying why in the job's output) if it listens beyond the
    node's loopback: the relay is its only way in."""
    while child.poll() is None and not listeners(port, child.pid):
        time.sleep(APP_LOOK_SECONDS)
    time.sleep(APP_LOOK_SECONDS)  # a server may open its addresses one after another
    problem = exposure(port, child.pid) if child.poll() is None else ""
    if problem:
        print(f"klique: {problem}; it is stopped", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)


def free_loopback_port() -> int:
    """A port no one on this host listens on now (the app binds it moments later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve_app(arguments: argparse.Namespace, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """An app's command with its port (picked on this node unless fixed), PORT for its environment, and
    its relay started, with both ports in the task's folder for the agent."""
    app_port = free_loopback_port() if arguments.app_port == "auto" else int(arguments.app_port)
    relay = AppRelay(Path(arguments.app_key_file).read_text().strip(), app_port)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    written = workdir / f"{APP_ADDRESS_FILE}.new"
    written.write_text(json.dumps({"relay": relay.port, "app": app_port}))
    written.replace(workdir / APP_ADDRESS_FILE)
    command = [word.replace("{port}", str(app_port)) for word in arguments.command]
    return command, {"PORT": str(app_port)}


def run(arguments: argparse.Namespace) -> int:
    rank = next((int(os.environ[name]) for name in RANK_VARIABLES if os.environ.get(name, "").isdigit()), 0)
    token = Path(arguments.token_file).read_text().strip()
    reporter = Reporter(arguments.url, arguments.task, token, f"node-{rank}")
    workdir = Path(arguments.workdir)
    metrics = Metrics(workdir / f"metrics-node{rank}.jsonl", arguments.metrics_seconds)
    environment = {**os.environ, "KLIQUE_TASK_ID": arguments.task, "KLIQUE_METRICS_FILE": str(metrics.path)}
    command = arguments.command
    if arguments.app_port:
        command, extra = serve_app(arguments, workdir)
        environment.update(extra)
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=arguments.chdir or workdir,
        env=environment,
    )

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    if arguments.app_port:
        threading.Thread(target=guard_app, args=(child, int(environment["PORT"])), daemon=True).start()
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
        sys.stdout.flush()  # the job's output file has the lines as they come (an app's failure quotes it)
        collect(reporter, buffered, lock, metrics)
        failures = 0 if reporter.flush() else failures + 1
    collect(reporter, buffered, lock, metrics)  # the last metric lines, written just before the command ended
    code = child.wait()
    code = code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
    if rank == 0:
        upload_outputs(reporter, workdir.resolve(), arguments.output)
        (workdir / "exit-code").write_text(str(code))
    deadline = time.monotonic() + arguments.final_seconds
    while not reporter.flush() and time.monotonic() < deadline:
        time.sleep(1)
    if reporter.pending:
        print(f"klique: {len(reporter.pending)} reports could not reach {arguments.url}", file=sys.stderr)
    return code


def relay(argv: list[str]) -> int:
    """`klique-node relay --port N --app-port M`: the relay alone, in front of an app on this loopback that
    another process serves (a pod's sidecar), until SIGTERM; the key is in $KLIQUE_APP_KEY."""
    parser = argparse.ArgumentParser(prog="klique-node relay", description=relay.__doc__)
    parser.add_argument("--port", type=int, required=True, help="where callers connect, on every address")
    parser.add_argument("--app-port", type=int, required=True, help="the app's port on this loopback")
    arguments = parser.parse_args(argv)
    if not all(1 <= port <= 65535 for port in (arguments.port, arguments.app_port)):
        parser.error("ports are whole numbers from 1 to 65535")
    try:
        server = AppRelay(os.environ.get(APP_KEY_VARIABLE, "").strip(), arguments.app_port, arguments.port)
    except ValueError:
        parser.error(f"${APP_KEY_VARIABLE} does not hold the run's app key (64 hexadecimal digits)")
    except OSError as error:
        print(f"klique-node relay: port {arguments.port} cannot be opened: {error}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda _signum, _frame: server.server.close())
    print(f"klique-node relay: port {server.port} leads to the app on port {arguments.app_port}", flush=True)
    server.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:
        return relay(argv[1:])
    parser = argparse.ArgumentParser(prog="klique-node", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the tenant's address")
    parser.add_argument("--task", required=True)
    parser.add_argument("--token-file", required=True, help="holds the task's token (mode 600)")
    parser.add_argument("--workdir", required=True, help="the task's folder: outputs and exit code")
    parser.add_argument("--chdir", help="run the command here instead of the task's folder")
    parser.add_argument("--output", action="append", default=[], help="a file pattern to upload at the end")
    parser.add_argument("--final-seconds", type=float, default=60.0, help="keep trying the last reports")
    parser.add_argument("--metrics-seconds", type=float, default=30.0, help="GPU samples; 0 turns them off")
    parser.add_argument("--app-port", help="the command is an app: its port, or auto to pick one here")
    parser.add_argument("--app-key-file", help="an app's key for its relay (mode 600)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    arguments = parser.parse_args(argv)
    if arguments.command[:1] == ["--"]:
        arguments.command = arguments.command[1:]
    if not arguments.command:
        parser.error("give the command after --")
    if bool(arguments.app_port) != bool(arguments.app_key_file):
        parser.error("an app needs both --app-port and --app-key-file")
    if arguments.app_port and arguments.app_port != "auto" and not arguments.app_port.isdigit():
        parser.error("--app-port is a port number or auto")
    return run(arguments)


if __name__ == "__main__":
    sys.exit(main())
