"""The agent's output upload against a real HTTP server that answers as a plane in trouble would: it
retries what means "not now" (down, restarting, full, not writable, a digest that did not match) with
backoff, gives up on what will never work, and always says why in words, never a parse error of an HTML
error page."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agents.baremetal import BareMetal
from agents.main import Agent, UploadFailed
from agents.state import State


class Plane(BaseHTTPRequestHandler):
    answers: list[tuple[int, str, bytes]] = []  # (status, content type, body), one per request, then 201
    received: list[dict[str, object]] = []

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Plane.received.append(
            {"lease": self.headers["X-Klique-Lease"], "sha256": self.headers["X-Klique-Sha256"], "body": body}
        )
        status, kind, text = Plane.answers.pop(0) if Plane.answers else (201, "application/json", b"{}")
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def plane() -> Iterator[str]:
    Plane.answers, Plane.received = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Plane)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def uploader(tmp_path: Path, url: str, patience: float = 30.0) -> tuple[Agent, Path]:
    state = State(tmp_path / "agent.sqlite")
    state.lease_begin("t", "lease-1", 1)
    agent = Agent(url=url, token="kqa_x_y", backend=BareMetal(1, tmp_path, state), agent_id="a")
    agent.upload_patience = patience
    output = tmp_path / "result.bin"
    output.write_bytes(b"\x00weights" * 1000)
    return agent, output


HTML_500 = (500, "text/html", b"<html><body><h1>Server Error (500)</h1></body></html>")


def test_answers_that_mean_not_now_are_retried_until_the_file_is_stored(tmp_path: Path, plane: str) -> None:
    Plane.answers = [
        HTML_500,
        (507, "application/json", b'{"detail": "Output result.bin could not be stored: the store is full."}'),
        (503, "application/json", b'{"detail": "the plane\'s file store is not writable"}'),
        (422, "application/json", b'{"detail": "arrived with another SHA-256"}'),
    ]
    agent, output = uploader(tmp_path, plane)
    asyncio.run(agent.upload("t", "result.bin", output))
    assert len(Plane.received) == 5
    digest = hashlib.sha256(output.read_bytes()).hexdigest()
    assert {(str(seen["lease"]), str(seen["sha256"])) for seen in Plane.received} == {("lease-1", digest)}
    assert all(seen["body"] == output.read_bytes() for seen in Plane.received)


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ((409, "application/json", b'{"detail": "Lease lease-1 is not the current run", "verdict": "stale"}'),
         "409: Lease lease-1 is not the current run"),
        ((413, "application/json", b'{"detail": "Output result.bin is too large."}'), "too large"),
        ((400, "text/html", b"<html><p>Bad Request</p></html>"), "400: <html><p>Bad Request</p></html>"),
    ],
)  # fmt: skip
def test_answers_that_will_never_work_are_not_retried_and_say_why(
    tmp_path: Path, plane: str, answer: tuple[int, str, bytes], words: str
) -> None:
    Plane.answers = [answer]
    agent, output = uploader(tmp_path, plane)
    with pytest.raises(UploadFailed, match="the plane answered") as failed:
        asyncio.run(agent.upload("t", "result.bin", output))
    assert words in str(failed.value)
    assert len(Plane.received) == 1


def test_a_plane_that_stays_away_is_given_up_on_after_the_patience_saying_so(tmp_path: Path) -> None:
    agent, output = uploader(tmp_path, "http://127.0.0.1:9", patience=1.0)  # nothing listens there
    with pytest.raises(UploadFailed, match=r"cannot be reached .*gave up after 1 s of retries"):
        asyncio.run(agent.upload("t", "result.bin", output))
