"""Calling a model that one of the tenant's apps serves: through the app's tunnel, never over the network.

The app runs where its agent put it (no inbound port); its agent's tunnel (apps.catalogue.tunnel) carries
the call, as it carries the app's route. This is an httpx transport, so the gateway's upstream code
(gateway.upstream) calls a self-hosted deployment exactly as it calls any OpenAI-compatible server,
streaming included. The deployment's address names the tenant's schema and the app
(gateway.services.selfhosted_api_base).

An app with no tunnel is starting, or asleep (stopped for idleness, scaling to zero): the call asks for it
to be started and waits for its tunnel, up to the app's start-up time; calls that arrive meanwhile wait on
the same start. A call that reaches the app marks it as used (its idle timeout counts from there).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
from channels.layers import get_channel_layer

from apps.core.threads import in_db_thread as _db
from apps.core.tunnels import ACCEPT_SECONDS, ACCEPTED, Stream, reason
from gateway import services
from protocol import tunnel

CHANNEL_SECONDS = 2.0  # how long a tunnel's channel is used without asking the database again
TOUCH_SECONDS = 30.0  # how often a call marks its app as used, at most
POLL_SECONDS = 0.5  # how often a call waiting for a starting app looks for its tunnel
MAX_START_SECONDS = 1800.0  # the longest a call waits for an app to start
PASSED = frozenset({b"content-type", b"accept", b"content-length", b"user-agent"})


class NotServing(httpx.ConnectError):
    """The app serves nothing now: it is stopped for good, or did not start in time."""


def _parts(url: httpx.URL) -> tuple[str, str, str]:
    """(schema, app id, the path and query the app is asked for) from a deployment's address."""
    _, schema, app_id, rest = url.raw_path.decode("latin-1").split("/", 3)
    return schema, app_id, "/" + rest


class TunnelTransport(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self.channels: dict[str, tuple[str, float]] = {}  # app id: (its tunnel's channel, read at)
        self.touched: dict[str, float] = {}
        self.starting: dict[str, asyncio.Task[str]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        schema, app_id, target = _parts(request.url)
        body = await request.aread()
        answer_seconds = float((request.extensions.get("timeout") or {}).get("read") or 600.0)
        headers = [(name.lower(), value) for name, value in request.headers.raw if name.lower() in PASSED]
        head = {
            "method": request.method,
            "target": target,
            "headers": tunnel.header_list(headers),
            "body": bool(body),
        }
        for fresh in (False, True):
            channel = await self._channel(schema, app_id, fresh=fresh)
            stream = Stream(get_channel_layer(), channel)
            await stream.open(head)
            kind, _ = await stream.next(ACCEPT_SECONDS)
            if kind != ACCEPTED:  # its web process is gone: ask the database for the tunnel now
                await stream.close()
                self.channels.pop(app_id, None)
                await _db(services.selfhosted_tunnel_gone)(app_id, channel, schema=schema)
                continue
            for start in range(0, len(body), tunnel.MAX_CHUNK):
                await stream.send(tunnel.DATA, body[start : start + tunnel.MAX_CHUNK])
            await stream.send(tunnel.END)  # the agent reads to END, with a body or without
            kind, payload = await stream.next(answer_seconds)
            if kind != tunnel.HEAD:
                with contextlib.suppress(Exception):
                    await stream.send(tunnel.RESET, b'{"reason": "no answer in time"}')
                await stream.close()
                raise httpx.ReadError(reason(payload) if payload else "the model did not answer in time")
            await self._touch(schema, app_id)
            answer = tunnel.Frame(0, kind, payload).document()
            return httpx.Response(
                int(answer.get("status", 502)),
                headers=tunnel.headers(answer.get("headers", [])),
                stream=_Body(stream, answer_seconds),
                request=request,
            )
        raise httpx.ConnectError("the app's tunnel does not answer; its agent reconnects it")

    async def _channel(self, schema: str, app_id: str, *, fresh: bool) -> str:
        kept = self.channels.get(app_id)
        if kept is not None and not fresh and time.monotonic() - kept[1] < CHANNEL_SECONDS:
            return kept[0]
        serving = await _db(services.selfhosted_serving)(schema, app_id)
        if serving is None:
            raise NotServing("its app no longer serves it")
        if serving.channel:
            self.channels[app_id] = (serving.channel, time.monotonic())
            return str(serving.channel)
        waiting = self.starting.get(app_id)
        if waiting is None or waiting.done():
            waiting = self.starting[app_id] = asyncio.create_task(self._start(schema, app_id, serving))
        return await asyncio.shield(waiting)

    async def _start(self, schema: str, app_id: str, serving: services.Serving) -> str:
        """Start the app (where it sleeps) and wait for its tunnel."""
        await _db(services.selfhosted_wake)(schema, app_id)
        limit = min(serving.startup_seconds + 120.0, MAX_START_SECONDS)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
            now = await _db(services.selfhosted_serving)(schema, app_id)
            if now is None:
                raise NotServing(f"{serving.label} was stopped")
            if now.channel:
                self.channels[app_id] = (now.channel, time.monotonic())
                return str(now.channel)
        raise NotServing(f"{serving.label} is starting and was not ready within {limit:.0f} s; call again")

    async def _touch(self, schema: str, app_id: str) -> None:
        now = time.monotonic()
        if now - self.touched.get(app_id, 0.0) >= TOUCH_SECONDS:
            self.touched[app_id] = now
            await _db(services.selfhosted_serving)(schema, app_id, called=True)


class _Body(httpx.AsyncByteStream):
    """The app's answer, chunk by chunk, with credits back to its agent as they are read."""

    def __init__(self, stream: Stream, answer_seconds: float) -> None:
        self.stream, self.answer_seconds = stream, answer_seconds
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        delivered = 0
        while True:
            kind, payload = await self.stream.next(self.answer_seconds)
            if kind == tunnel.DATA:
                yield payload
                delivered += 1
                if delivered % (tunnel.WINDOW // 2) == 0:
                    await self.stream.send(tunnel.CREDIT, (tunnel.WINDOW // 2).to_bytes(4, "big"))
            elif kind == tunnel.END:
                self.finished = True
                return
            else:
                self.finished = True
                raise httpx.ReadError(reason(payload))

    async def aclose(self) -> None:
        if not self.finished:  # the caller went away: the app stops answering
            with contextlib.suppress(Exception):
                await self.stream.send(tunnel.RESET, b'{"reason": "the caller went away"}')
        await self.stream.close()
