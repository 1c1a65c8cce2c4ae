"""What every websocket consumer of Klique shares: reading a handshake header, and the refusal that
closes the socket with a code and a sentence."""

from __future__ import annotations

from typing import Any


class WebsocketRejected(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def header(scope: dict[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return ""
