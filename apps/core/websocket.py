"""What every websocket consumer of Klique shares: reading a handshake header, the refusal that
closes the socket with a code and a sentence, and dispatch without a trip to the database thread."""

from __future__ import annotations

from typing import Any

from channels.consumer import get_handler_name


class WebsocketRejected(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def header(scope: dict[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return ""


class DirectDispatch:
    """Channels' consumers close the database connections of the database thread before every message
    they dispatch: a trip through asgiref's one thread-sensitive executor, in line behind every other
    consumer's database work in the process. A consumer whose database work all goes through
    `database_sync_to_async` (which closes them around each call anyway) needs none of it: without it,
    a message is taken off the socket at once, not after the database work queued before it."""

    async def dispatch(self, message: dict[str, Any]) -> None:
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)
