"""One request's end of an app's tunnel, over the channel layer: what the app route (apps.catalogue.route)
and the gateway's self-hosted deployments (gateway.selfhosted) both speak to the tunnel consumer
(apps.catalogue.tunnel), in whichever web process holds the agent's socket.

The request sends `tunnel.open` (its head and the channel to answer on), then frames; the consumer answers
ACCEPTED once its agent's socket took the stream, then the app's frames (protocol.tunnel). One task reads
the answer channel into a queue: a receive that times out would unsubscribe the channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from protocol import tunnel

ACCEPTED = 0  # a frame kind of the plane's own: the tunnel took the stream (the request stops waiting)
TUNNEL_DROPPED = "The app's tunnel dropped; its agent reconnects it. Try again."
# The RESET the tunnel's consumer sends for each stream when its agent's socket goes: said as such, so that
# a request is sent again (or a websocket resumed) on this and on nothing else a RESET may say.
DROPPED = json.dumps({"reason": TUNNEL_DROPPED, "dropped": True}).encode()
ACCEPT_SECONDS = 10.0  # how long a tunnel may take to take a request before it is given up on


class Stream:
    """One request's end of the channel layer: frames to the tunnel, frames back into a queue."""

    def __init__(self, layer: Any, channel: str) -> None:
        self.layer, self.channel = layer, channel
        self.frames: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self.reply = ""
        self.reader: asyncio.Task[None] | None = None

    async def open(self, head: dict[str, Any]) -> None:
        self.reply = await self.layer.new_channel("route.")
        self.reader = asyncio.create_task(self._read())
        await self.layer.send(self.channel, {"type": "tunnel.open", "reply": self.reply, "head": head})

    async def _read(self) -> None:
        while True:
            message = await self.layer.receive(self.reply)
            await self.frames.put((int(message["kind"]), bytes(message.get("payload") or b"")))

    async def send(self, kind: int, payload: bytes = b"") -> None:
        await self.layer.send(
            self.channel, {"type": "tunnel.frame", "reply": self.reply, "kind": kind, "payload": payload}
        )

    async def next(self, timeout: float) -> tuple[int, bytes]:
        try:
            return await asyncio.wait_for(self.frames.get(), timeout)
        except TimeoutError:
            return tunnel.RESET, b""

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()  # the layer unsubscribes the reply channel
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reader


def dropped(payload: bytes) -> bool:
    """Whether a RESET is the tunnel's drop (not the app's or the agent's own refusal)."""
    try:
        return tunnel.Frame(0, tunnel.RESET, payload).document().get("dropped") is True
    except tunnel.FrameError:
        return False


def reason(payload: bytes) -> str:
    """What a RESET frame says went wrong."""
    try:
        detail = tunnel.Frame(0, tunnel.RESET, payload).document().get("reason")
    except tunnel.FrameError:
        detail = payload.decode(errors="replace")
    return str(detail or TUNNEL_DROPPED)[:300]
