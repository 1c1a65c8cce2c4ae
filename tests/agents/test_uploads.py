"""The agent's output upload against a real HTTP server that answers as a plane in trouble would: it
retries what means "not now" (down, restarting, full, not writable, a digest that did not match) with
backoff, gives up on what will never work, and always says why in words, never a parse error of an HTML
error page. With a ticket for a project's bucket, it PUTs to the bucket's URL (a second server here) with
the ticket's signed headers and nothing of its own, and starts again from a new ticket when the bucket or
the receipt refuses."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agents.baremetal import BareMetal
from agents.main import Agent, UploadFailed
from agents.state import State


def answer(handler: BaseHTTPRequestHandler, status: int, kind: str, text: bytes) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(text)))
    handler.end_headers()
    handler.wfile.write(text)


PLANE_TICKET = (200, "application/json", b'{"store": "plane"}')


class Plane(BaseHTTPRequestHandler):
    answers: list[tuple[int, str, bytes]] = []  # (status, content type, body), one per request, then 201
    received: list[dict[str, object]] = []
    tickets: list[tuple[int, str, bytes]] = []  # one per ticket asked for, then PLANE_TICKET
    receipts: list[tuple[int, str, bytes]] = []  # one per receipt, then 201
    posted: list[tuple[str, dict[str, object], str]] = []  # (path, body, authorization) of each POST

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Plane.posted.append((self.path, body, self.headers["Authorization"]))
        if "/output-tickets/" in self.path:
            answer(self, *(Plane.tickets.pop(0) if Plane.tickets else PLANE_TICKET))
        else:
            answer(self, *(Plane.receipts.pop(0) if Plane.receipts else (201, "application/json", b"{}")))

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Plane.received.append(
            {"lease": self.headers["X-Klique-Lease"], "sha256": self.headers["X-Klique-Sha256"], "body": body}
        )
        answer(self, *(Plane.answers.pop(0) if Plane.answers else (201, "application/json", b"{}")))

    def log_message(self, *args: object) -> None:
        pass


class Bucket(BaseHTTPRequestHandler):
    answers: list[tuple[int, str, bytes]] = []  # one per PUT, then 200
    received: list[dict[str, object]] = []

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Bucket.received.append({"path": self.path, "headers": dict(self.headers), "body": body})
        status, kind, text = Bucket.answers.pop(0) if Bucket.answers else (200, "text/plain", b"")
        self.send_response(status)
        if status in (301, 307):
            self.send_header("Location", "http://127.0.0.1:9/elsewhere")
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, *args: object) -> None:
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def plane() -> Iterator[str]:
    Plane.answers, Plane.received, Plane.tickets, Plane.receipts, Plane.posted = [], [], [], [], []
    yield from serve(Plane)


@pytest.fixture
def bucket() -> Iterator[str]:
    Bucket.answers, Bucket.received = [], []
    yield from serve(Bucket)


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


def s3_ticket(bucket: str, n: int) -> tuple[int, str, bytes]:
    ticket = {
        "store": "s3",
        "url": f"{bucket}/outputs/t/lease-1/result.bin?X-Amz-Signature=sig{n}",
        "headers": {"x-amz-checksum-sha256": "c2lnbmVk", "Content-Type": "application/octet-stream"},
        "expires_in": 900,
    }
    return (200, "application/json", json.dumps(ticket).encode())


S3_EXPIRED = (
    403,
    "application/xml",
    b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>",
)


def test_with_a_bucket_ticket_the_file_goes_to_the_bucket_alone_then_a_receipt_to_the_plane(
    tmp_path: Path, plane: str, bucket: str
) -> None:
    Plane.tickets = [s3_ticket(bucket, 1)]
    agent, output = uploader(tmp_path, plane)
    asyncio.run(agent.upload("t", "result.bin", output))
    digest = hashlib.sha256(output.read_bytes()).hexdigest()
    assert Plane.received == []  # nothing of the file went through the plane
    [stored] = Bucket.received
    assert stored["body"] == output.read_bytes()
    assert str(stored["path"]).endswith("X-Amz-Signature=sig1")
    headers = {key.lower(): value for key, value in dict(stored["headers"]).items()}  # type: ignore[call-overload]
    assert headers["x-amz-checksum-sha256"] == "c2lnbmVk"
    assert "authorization" not in headers  # the agent's token stays home
    assert "x-klique-lease" not in headers
    paths = [path for path, _, _ in Plane.posted]
    assert paths == [
        "/agents/v1/tasks/t/output-tickets/result.bin",
        "/agents/v1/tasks/t/output-receipts/result.bin",
    ]
    assert all(body == {"sha256": digest, "size": output.stat().st_size} for _, body, _ in Plane.posted)
    assert all(authorization == "Bearer kqa_x_y" for _, _, authorization in Plane.posted)


@pytest.mark.parametrize(
    ("bucket_answers", "receipt_answers"),
    [
        ([S3_EXPIRED], []),  # the URL expired before the PUT: a new ticket
        ([(503, "application/xml", b"<Error><Code>SlowDown</Code></Error>")], []),  # the bucket busy
        (
            [(400, "application/xml", b"<Error><Code>BadDigest</Code></Error>")],
            [],
        ),  # the file changed under it
        (
            [],
            [(422, "application/json", b'{"detail": "s3://b/k is not in the bucket"}')],
        ),  # lost after the PUT
        ([], [(503, "application/json", b'{"detail": "The bucket cannot be reached from the plane"}')]),
    ],
)
def test_a_bucket_or_receipt_refusal_starts_again_from_a_new_ticket(
    tmp_path: Path,
    plane: str,
    bucket: str,
    bucket_answers: list[tuple[int, str, bytes]],
    receipt_answers: list[tuple[int, str, bytes]],
) -> None:
    Plane.tickets = [s3_ticket(bucket, 1), s3_ticket(bucket, 2)]
    Bucket.answers, Plane.receipts = list(bucket_answers), list(receipt_answers)
    agent, output = uploader(tmp_path, plane)
    asyncio.run(agent.upload("t", "result.bin", output))
    assert [str(seen["path"])[-4:] for seen in Bucket.received] == ["sig1", "sig2"]
    tickets = [path for path, _, _ in Plane.posted if "output-tickets" in path]
    receipts = [path for path, _, _ in Plane.posted if "output-receipts" in path]
    assert len(tickets) == 2
    assert len(receipts) == 1 + len(receipt_answers)


def test_a_bucket_that_keeps_refusing_is_given_up_on_in_its_own_words(
    tmp_path: Path, plane: str, bucket: str
) -> None:
    Plane.tickets = [s3_ticket(bucket, n) for n in range(50)]
    Bucket.answers = [S3_EXPIRED] * 50
    agent, output = uploader(tmp_path, plane, patience=1.0)
    with pytest.raises(
        UploadFailed, match=r"the bucket answered 403: AccessDenied Request has expired; gave up"
    ):
        asyncio.run(agent.upload("t", "result.bin", output))


def test_a_bucket_redirect_is_not_followed(tmp_path: Path, plane: str, bucket: str) -> None:
    Plane.tickets = [s3_ticket(bucket, n) for n in range(50)]
    Bucket.answers = [(307, "application/xml", b"<Error><Code>TemporaryRedirect</Code></Error>")] * 50
    agent, output = uploader(tmp_path, plane, patience=1.0)
    with pytest.raises(UploadFailed, match=r"the bucket answered 307: TemporaryRedirect"):
        asyncio.run(agent.upload("t", "result.bin", output))
    assert Plane.received == []  # and the file went nowhere else


@pytest.mark.parametrize(
    "refusal",
    [
        (409, "application/json", b'{"detail": "Project vision is limited to eu-west-1, its bucket not"}'),
        (400, "application/json", b'{"detail": "sha256 must be the file\'s SHA-256"}'),
        (200, "application/json", b'{"store": "ftp"}'),
    ],
)  # fmt: skip
def test_a_ticket_that_will_never_come_fails_at_once_saying_why(
    tmp_path: Path, plane: str, bucket: str, refusal: tuple[int, str, bytes]
) -> None:
    Plane.tickets = [refusal]
    agent, output = uploader(tmp_path, plane)
    with pytest.raises(UploadFailed) as failed:
        asyncio.run(agent.upload("t", "result.bin", output))
    assert (
        ("limited to eu-west-1" in str(failed.value))
        or ("SHA-256" in str(failed.value))
        or ("names its store" in str(failed.value))
    )
    assert Plane.received == []
    assert Bucket.received == []


def test_a_plane_without_tickets_takes_the_file_itself(tmp_path: Path, plane: str) -> None:
    Plane.tickets = [(404, "text/html", b"<h1>Not Found</h1>")]
    agent, output = uploader(tmp_path, plane)
    asyncio.run(agent.upload("t", "result.bin", output))
    assert [seen["body"] for seen in Plane.received] == [output.read_bytes()]
