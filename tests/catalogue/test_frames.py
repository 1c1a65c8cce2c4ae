"""The tunnel's frames, read by the plane and the agent alike: anything else is refused, headers cannot
carry a line break into the request the app receives, and hop-by-hop headers never pass."""

from __future__ import annotations

import pytest

from protocol import tunnel


@pytest.mark.parametrize("kind", sorted(tunnel.KINDS))
def test_a_frame_reads_back_as_it_was_sent(kind: int) -> None:
    raw = tunnel.frame(70000, kind, b"\x00\x01payload")
    assert tunnel.Frame.decode(raw) == tunnel.Frame(70000, kind, b"\x00\x01payload")


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"", "binary"),
        (b"\x00\x00\x00", "binary"),
        ("text", "binary"),
        (b"\x00\x00\x00\x01\x09", "kind 9"),
        (b"\x00\x00\x00\x01\x00", "kind 0"),
        (tunnel.frame(1, tunnel.DATA, b"x" * (tunnel.MAX_MESSAGE + 1)), "at most"),
        (tunnel.frame(1, tunnel.OPEN, b"x" * (tunnel.MAX_HEAD + 1)), "at most"),
    ],
)
def test_a_malformed_frame_is_refused(raw: object, problem: str) -> None:
    with pytest.raises(tunnel.FrameError, match=problem):
        tunnel.Frame.decode(raw)  # type: ignore[arg-type]


def test_a_frames_document_is_a_json_object() -> None:
    assert tunnel.Frame.decode(tunnel.frame(1, tunnel.HEAD, {"status": 200})).document() == {"status": 200}
    for payload in (b"[1]", b"{", b"\xff"):
        with pytest.raises(tunnel.FrameError):
            tunnel.Frame(1, tunnel.HEAD, payload).document()


@pytest.mark.parametrize(
    "pairs",
    [
        [["x-a", "one\r\nSet-Cookie: stolen=1"]],
        [["x-a", "one\nx"]],
        [["x-a", "a\x00"]],
        [["bad name", "v"]],
        [["x:y", "v"]],
        [["", "v"]],
        [["x-a"]],
        [["x-a", 1]],
        "x-a: 1",
        [["x", "v"]] * (tunnel.MAX_HEADERS + 1),
    ],
)
def test_headers_that_could_split_a_request_are_refused(pairs: object) -> None:
    with pytest.raises(tunnel.FrameError):
        tunnel.headers(pairs)


def test_hop_by_hop_headers_do_not_pass() -> None:
    passed = tunnel.headers(
        [["Connection", "close"], ["Transfer-Encoding", "chunked"], ["Host", "x"], ["Origin", "https://evil"],
         ["Content-Type", "text/plain"], ["Content-Length", "4"]]
    )  # fmt: skip
    assert passed == [(b"content-type", b"text/plain"), (b"content-length", b"4")]


def test_credit_carries_a_count() -> None:
    assert tunnel.credit_count(tunnel.Frame.decode(tunnel.credit(3, 16))) == 16
    with pytest.raises(tunnel.FrameError):
        tunnel.credit_count(tunnel.Frame(3, tunnel.CREDIT, b"\x01"))


def test_an_outbox_sends_again_exactly_what_the_other_side_missed() -> None:
    box = tunnel.Outbox()
    for number in range(1, 6):
        box.record(tunnel.TEXT, str(number).encode())
    assert box.after(5) == []
    assert box.after(3) == [(tunnel.TEXT, b"4"), (tunnel.TEXT, b"5")]
    assert box.after(0) == [(tunnel.TEXT, str(n).encode()) for n in range(1, 6)]
    box.acknowledged(2)  # the other side has the first two for certain: they are let go
    assert box.after(2) == [(tunnel.TEXT, b"3"), (tunnel.TEXT, b"4"), (tunnel.TEXT, b"5")]
    assert box.after(1) is None  # the second was let go: that side cannot have missed it
    assert box.after(6) is None  # more than was ever sent: not this websocket's count
    box.acknowledged(5)
    assert box.after(5) == []
    assert box.after(4) is None


def test_an_outbox_that_keeps_too_much_gives_up_resuming() -> None:
    by_count = tunnel.Outbox()
    for _ in range(tunnel.RESUME_MESSAGES + 1):
        by_count.record(tunnel.DATA, b"x")
    assert by_count.overflowed
    assert by_count.after(by_count.sent) is None
    by_size = tunnel.Outbox()
    by_size.record(tunnel.DATA, b"x" * (tunnel.RESUME_BYTES + 1))
    assert by_size.overflowed
    assert by_size.kept == []  # nothing held for a resume that cannot come


@pytest.mark.parametrize("payload", [b"", b"\x00" * 4, b"\x00" * 9])
def test_an_ack_carries_an_eight_byte_count(payload: bytes) -> None:
    with pytest.raises(tunnel.FrameError):
        tunnel.ack_count(tunnel.Frame(1, tunnel.ACK, payload))
    assert tunnel.ack_count(tunnel.Frame.decode(tunnel.ack(3, 2**40))) == 2**40
