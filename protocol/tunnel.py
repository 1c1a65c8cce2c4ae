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

Flow control: the agent sends at most WINDOW DATA frames of a stream ahead of the plane's credits, so a
slow client holds back the app's answer, not the plane's memory.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

OPEN, DATA, END, HEAD, RESET, CREDIT, TEXT = 1, 2, 3, 4, 5, 6, 7
KINDS = frozenset({OPEN, DATA, END, HEAD, RESET, CREDIT, TEXT})
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
