"""An app's tunnel: the frames that carry requests to an app, and its answers, over the websocket its
agent opens to the plane (/agents/tunnel/), outbound like everything an agent opens.

Each frame is binary: a stream id (4 bytes, big-endian), a kind (1 byte), then its payload. A stream is
one request to the app (or one websocket through the route); the plane numbers the streams it opens.

    OPEN   plane -> agent  {"method", "target", "headers": [[name, value], ...], "body": bool,
                           "websocket": bool}
    DATA   both            bytes of a body (at most MAX_CHUNK), or one binary websocket message
    TEXT   both            one text websocket message (UTF-8)
    END    both            no more from this side (the body is complete; the websocket closed, payload
                           {"code"} then)
    HEAD   agent -> plane  {"status", "headers"}: the app's answer begins (for a websocket: accepted)
    RESET  both            {"reason"}: the stream is given up; the other side ends it at once
    CREDIT plane -> agent  4 bytes: how many more DATA frames of the stream the plane can take now
    ACK    both            8 bytes: how many messages of a websocket this side has received so far

Flow control: the agent sends at most WINDOW DATA frames of a stream ahead of the plane's credits, so a
slow client holds back the app's answer, not the plane's memory.

A websocket outlives its tunnel. Its OPEN names it (`"resume": <id>`), and each side keeps the messages it
sent until the other acknowledges them (an ACK every ACK_EVERY messages). When the tunnel drops, the agent
keeps the app's end open for RESUME_SECONDS. The route keeps the client's end open and opens the stream
again on the agent's next tunnel, with the same id and the count of messages it received
(`"received": n`). The agent answers HEAD with its own count, and each side sends again what the other
did not receive: no message is lost or doubled. A side that holds more than RESUME_MESSAGES or
RESUME_BYTES unacknowledged cannot resume, and the websocket closes (1012) as it would without this.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

OPEN, DATA, END, HEAD, RESET, CREDIT, TEXT, ACK = 1, 2, 3, 4, 5, 6, 7, 8
KINDS = frozenset({OPEN, DATA, END, HEAD, RESET, CREDIT, TEXT, ACK})
RESUME_SECONDS = 60.0  # how long the agent keeps an app's websocket whose tunnel dropped
RESUME_MESSAGES = 1024  # unacknowledged messages a side keeps to send again
RESUME_BYTES = 16 * 1024 * 1024
ACK_EVERY = 16
MAX_CHUNK = 64 * 1024
MAX_MESSAGE = 1024 * 1024  # one websocket message through the route
MAX_FRAME = MAX_MESSAGE + 5
MAX_HEAD = 64 * 1024  # the JSON of an OPEN or HEAD: its headers
MAX_HEADERS = 100
WINDOW = 32  # DATA frames of one stream the agent sends before it waits for credit
_HEADER = struct.Struct("!IB")
# Headers that belong to one connection, not to the request: never passed through. (Origin is checked by
# the route and said again by the agent as the app's own: the app sees a request from itself.)
HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
        b"transfer-encoding", b"upgrade", b"proxy-connection", b"host", b"origin",
    }
)  # fmt: skip
# What a websocket's own handshake sets; the agent's client makes its own.
WEBSOCKET_HANDSHAKE = frozenset(
    {b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions", b"sec-websocket-accept"}
)


class FrameError(ValueError):
    """A frame that does not follow the tunnel's format; the text says what."""


@dataclass(frozen=True, slots=True)
class Frame:
    stream: int
    kind: int
    payload: bytes = b""

    def encode(self) -> bytes:
        return _HEADER.pack(self.stream, self.kind) + self.payload

    @classmethod
    def decode(cls, raw: bytes) -> Frame:
        if not isinstance(raw, bytes | bytearray) or len(raw) < _HEADER.size:
            raise FrameError("a tunnel frame is binary: a stream id, a kind, then its payload.")
        if len(raw) > MAX_FRAME:
            raise FrameError(f"a tunnel frame is at most {MAX_FRAME} bytes.")
        stream, kind = _HEADER.unpack_from(raw)
        if kind not in KINDS:
            raise FrameError(f"frame kind {kind} is not one of the tunnel's.")
        payload = bytes(raw[_HEADER.size :])
        if kind in (OPEN, HEAD, RESET) and len(payload) > MAX_HEAD:
            raise FrameError(f"an OPEN, HEAD or RESET frame's payload is at most {MAX_HEAD} bytes.")
        if kind == DATA and len(payload) > MAX_MESSAGE:
            raise FrameError(f"a DATA frame carries at most {MAX_MESSAGE} bytes.")
        return cls(stream, kind, payload)

    def document(self) -> dict[str, Any]:
        """The JSON payload of an OPEN, HEAD, RESET or END frame."""
        if not self.payload:
            return {}
        try:
            value = json.loads(self.payload)
        except ValueError:
            raise FrameError("the frame's payload is not JSON.") from None
        if not isinstance(value, dict):
            raise FrameError("the frame's payload is a JSON object.")
        return value


def frame(stream: int, kind: int, payload: bytes | dict[str, Any] = b"") -> bytes:
    body = json.dumps(payload).encode() if isinstance(payload, dict) else payload
    return Frame(stream, kind, body).encode()


def credit(stream: int, count: int) -> bytes:
    return frame(stream, CREDIT, struct.pack("!I", count))


def credit_count(item: Frame) -> int:
    if len(item.payload) != 4:
        raise FrameError("a CREDIT frame carries a 4-byte count.")
    return int(struct.unpack("!I", item.payload)[0])


def headers(value: object) -> list[tuple[bytes, bytes]]:
    """Headers of an OPEN or HEAD frame: at most MAX_HEADERS pairs of printable text, hop-by-hop left out."""
    if not isinstance(value, list) or len(value) > MAX_HEADERS:
        raise FrameError(f"headers are a list of at most {MAX_HEADERS} [name, value] pairs.")
    found: list[tuple[bytes, bytes]] = []
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(part, str) for part in pair)):
            raise FrameError("each header is a [name, value] pair of text.")
        name, text = pair[0].lower().encode("latin-1", "replace"), pair[1].encode("latin-1", "replace")
        if (
            not name
            or any(c <= 32 or c >= 127 or c == 58 for c in name)
            or any(c in b"\r\n\x00" for c in text)
        ):
            raise FrameError("a header's name is a token and its value has no line breaks.")
        if name not in HOP_BY_HOP:
            found.append((name, text))
    return found


def header_list(pairs: list[tuple[bytes, bytes]]) -> list[list[str]]:
    """ASGI headers as the frames carry them."""
    return [[name.decode("latin-1"), value.decode("latin-1")] for name, value in pairs]


def ack_payload(received: int) -> bytes:
    return struct.pack("!Q", received)


def ack(stream: int, received: int) -> bytes:
    return frame(stream, ACK, ack_payload(received))


def ack_count(item: Frame) -> int:
    if len(item.payload) != 8:
        raise FrameError("an ACK frame carries an 8-byte count.")
    return int(struct.unpack("!Q", item.payload)[0])


class Outbox:
    """One side of a websocket through the tunnel: the messages it sent that the other side has not
    acknowledged yet, numbered from 1, to send again after a tunnel drops."""

    def __init__(self) -> None:
        self.sent = 0  # messages sent so far
        self.kept: list[tuple[int, int, bytes]] = []  # (number, kind, payload), oldest first
        self.size = 0
        self.overflowed = False  # more kept than allowed: this websocket cannot resume

    def record(self, kind: int, payload: bytes) -> None:
        self.sent += 1
        if self.overflowed:
            return
        self.kept.append((self.sent, kind, payload))
        self.size += len(payload)
        if len(self.kept) > RESUME_MESSAGES or self.size > RESUME_BYTES:
            self.overflowed, self.kept, self.size = True, [], 0

    def acknowledged(self, count: int) -> None:
        while self.kept and self.kept[0][0] <= count:
            self.size -= len(self.kept.pop(0)[2])

    def after(self, count: int) -> list[tuple[int, bytes]] | None:
        """What the other side did not receive, having received `count`; None where that is lost."""
        if count > self.sent:
            return None
        if (
            self.overflowed
            or (self.kept and self.kept[0][0] > count + 1)
            or (not self.kept and count < self.sent)
        ):
            return None
        return [(kind, payload) for number, kind, payload in self.kept if number > count]
