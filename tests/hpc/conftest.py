"""Agent-level HPC tests drive agents.hpc.Batch directly against the real Slurm of tests/slurm.py, with a
stand-in for the plane's two HTTPS endpoints that node reporters post to; tests/e2e/test_hpc.py runs the
whole path with a real control plane and agent process."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agents.hpc import DIALECTS, Batch, Settings
from agents.state import Position, State


@dataclass
class PlaneStandIn:
    """Records what node reporters post (reports) and put (outputs), as the plane would receive them."""

    url: str
    reports: list[dict[str, Any]] = field(default_factory=list)
    outputs: dict[str, bytes] = field(default_factory=dict)
    tokens: set[str] = field(default_factory=set)
    refuse: int = 0  # answer this many posts with 503 first, as a plane that is restarting would
    full: int = 0  # answer this many uploads with 507 first, as a plane whose store is full would
    digests: list[str] = field(default_factory=list)  # the X-Klique-Sha256 of each upload
    store: str = "plane"  # where tickets send outputs: "plane", or "s3" (this stand-in's /bucket/ too)
    bucket: dict[str, bytes] = field(default_factory=dict)  # key -> what was PUT to the bucket
    bucket_headers: list[dict[str, str]] = field(default_factory=list)
    bucket_refuse: int = 0  # answer this many bucket PUTs with 403 (a URL expired) first
    receipts: list[dict[str, Any]] = field(default_factory=list)  # (name, claim) of each receipt

    def metrics(self, task_id: str) -> list[dict[str, Any]]:
        return [r for r in self.reports if r["task_id"] == task_id and r["type"] == "metric"]

    def lines(self, task_id: str, stream: str = "stdout") -> list[str]:
        return [
            line
            for report in self.reports
            if report["task_id"] == task_id and report["type"] == "log" and report.get("stream") == stream
            for line in report["lines"]
        ]


@pytest.fixture
def plane() -> Iterator[PlaneStandIn]:
    recorder = PlaneStandIn(url="")

    class Handler(BaseHTTPRequestHandler):
        def _task(self) -> str:
            return self.path.split("/")[4]

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if "/output-tickets/" in self.path:
                name = self.path.split("/output-tickets/", 1)[1]
                if recorder.store == "plane":
                    self._answer(200, {"store": "plane"})
                    return
                url = f"{recorder.url}/bucket/{self._task()}/{name}?X-Amz-Signature=s"
                self._answer(
                    200, {"store": "s3", "url": url, "headers": {"x-amz-meta-klique-sha256": body["sha256"]}}
                )
                return
            if "/output-receipts/" in self.path:
                recorder.receipts.append({"name": self.path.split("/output-receipts/", 1)[1], **body})
                self._answer(201, {"name": body})
                return
            if recorder.refuse > 0:
                recorder.refuse -= 1
                self._answer(503, {"detail": "restarting"})
                return
            recorder.tokens.add(self.headers["Authorization"])
            recorder.reports += [{**item, "task_id": self._task()} for item in body["reports"]]
            self._answer(200, {"kept": len(body["reports"])})

        def do_PUT(self) -> None:
            if self.path.startswith("/bucket/"):
                content = self.rfile.read(int(self.headers["Content-Length"]))
                recorder.bucket_headers.append({k.lower(): v for k, v in self.headers.items()})
                if recorder.bucket_refuse > 0:
                    recorder.bucket_refuse -= 1
                    self._xml(
                        403, "<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
                    )
                    return
                recorder.bucket[self.path.split("?")[0].removeprefix("/bucket/")] = content
                self._xml(200, "")
                return
            name = self.path.split("/outputs/", 1)[1]
            content = self.rfile.read(int(self.headers["Content-Length"]))
            recorder.digests.append(self.headers.get("X-Klique-Sha256", ""))
            if recorder.full > 0:
                recorder.full -= 1
                self._answer(
                    507, {"detail": f"Output {name} could not be stored: the plane's file store is full."}
                )
                return
            recorder.outputs[f"{self._task()}/{name}"] = content
            self._answer(201, {"name": name})

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _xml(self, status: int, text: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    recorder.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield recorder
    server.shutdown()


class Reports:
    """What the backend would send the plane over the agent's websocket."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    async def __call__(self, task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        self.sent.append((task_id, kind, body))

    def of(self, task_id: str, kind: str) -> list[dict[str, Any]]:
        return [body for task, sent_kind, body in self.sent if task == task_id and sent_kind == kind]


def make_backend(scheduler: str, jobs: Path, plane: PlaneStandIn, state_dir: Path, **settings: Any) -> Batch:
    return Batch(
        DIALECTS[scheduler](),
        Settings(
            **{
                "jobs_dir": jobs,
                "user_map": {"alice": "kqalice", "bob": "kqbob"},
                "node_python": "/usr/bin/python3",
                "poll_seconds": 0.5,
                "allowed_roots": [jobs],
                **settings,
            }
        ),
        State(state_dir / "agent.sqlite"),
        plane.url,
    )


def assignment(
    task_id: str, command: list[str], *, gpus: int = 1, user: str = "alice", **extra: Any
) -> dict[str, Any]:
    spec = {"command": command, **extra.pop("spec", {})}
    return {
        "task_id": task_id,
        "lease_id": "lease",
        "name": extra.pop("name", "test"),
        "size_units": gpus * 840,
        "nodes": 1,
        "user": user,
        "task_token": f"kqt_{task_id}_signature",
        "spec": spec,
        **extra,
    }


async def until(
    condition: Any, timeout: float = 60.0, step: float = 0.2, seen: Callable[[], str] | None = None
) -> None:
    """Wait for condition(); on a timeout say what was seen (seen()), so that a failure can be read."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out waiting" + (f"; seen: {seen()}" if seen else ""))
        await asyncio.sleep(step)


def job_trace(plane: PlaneStandIn, jobs: Path, task_id: str) -> str:
    """What a job left behind (its folder's files, its output file) and what the plane got from its node
    reporters: the message of a wait that timed out."""
    folder = jobs / task_id
    files = sorted(path.name for path in folder.iterdir()) if folder.is_dir() else []
    output = (
        (folder / "output.log").read_text(errors="replace") if (folder / "output.log").is_file() else None
    )
    posted = [
        {k: v for k, v in r.items() if k != "task_id"} for r in plane.reports if r["task_id"] == task_id
    ]
    return f"files {files}, output.log {output!r}, posted {posted}"
