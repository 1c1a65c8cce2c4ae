"""The agent's end of an app's tunnel: find where the app is (its port on this host, or, for an app in a
batch job or a pod, the way to its relay: agents.relay), wait for it to answer its health check, then
open a websocket to the plane (/agents/tunnel/, outbound like the agent's own) and serve the requests that
come through it from the app (protocol.tunnel has the frames).

The tunnel names the app's run (task and lease) and is reconnected with backoff for as long as the run
lasts; the plane refuses it (4404) once the lease is not the task's live run, and then it stops trying.
An app that never answers its health check within its startup time is stopped, with a reason that says
so and the last lines of its log.

A websocket to the app outlives a tunnel that drops: its end at the app stays open for
tunnel.RESUME_SECONDS, what the app sends meanwhile is kept, and the route opens it again on the next
tunnel (protocol.tunnel says how).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import websockets

from agents import node
from protocol import tunnel
from protocol.apps import AppSpec

logger = logging.getLogger("klique.agent.tunnel")

HEALTH_EVERY = 1.0  # seconds between health checks while the app starts
CLOSE_SECONDS = 10.0  # how long an app's closed websocket waits for the route to say it has the close
# The plane no longer serves this run's route (4404), or refuses the agent's token (4401): stop trying.
REFUSED_BY_PLANE = frozenset({4401, 4404})
Fail = Callable[[str], Awaitable[None]]
Say = Callable[[str], Awaitable[None]]


def tunnel_address(url: str) -> tuple[str, dict[str, Any]]:
    """The tunnel's websocket URL for a tenant address, and where to connect (as agents.main does)."""
    parts = urlsplit(url.rstrip("/"))
    scheme = "wss" if parts.scheme == "https" else "ws"
    address = urlunsplit((scheme, parts.netloc, "/agents/tunnel/", "", ""))
    host = parts.hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return address, {"host": "127.0.0.1", "port": parts.port or (443 if scheme == "wss" else 80)}
    return address, {}


class Upstream:
    """Where the tunnel reaches the app: its port on this host (the bare-metal backend). An app on another
    host is reached through a subclass that leads there (agents.relay.NodeRelay)."""

    def __init__(self, port: int, group: int = 0) -> None:
        self.port, self.group = port, group  # the run's process group, where known

    @property
    def local(self) -> str:
        """The app's address as it sees itself (its Host, and the Origin the route checked already)."""
        return f"http://127.0.0.1:{self.port}"

    def describe(self) -> str:
        return f"port {self.port}"

    def exposure(self) -> str:
        """Why the app is reachable past its route ("" where it is not): on this host, an app that listens
        beyond the loopback; the run's own sockets where its processes hold them, else (an app in a
        container, whose processes are the engine's) whatever listens on its port."""
        return node.exposure(self.port, self.group)

    def transport(self) -> httpx.AsyncBaseTransport:
        return httpx.AsyncHTTPTransport()

    def websocket(self, uri: str, **options: Any) -> Any:
        """An awaitable websocket connection to the app (websockets' connect)."""
        return websockets.connect(uri, **options)

    async def aclose(self) -> None:
        """Let go of what leads to the app (nothing here)."""


# The app's run: where its app is once it serves, or None if the run ended before (it cannot be reached).
Locate = Callable[[], Awaitable[Upstream | None]]


@dataclass
class _Websocket:
    """A websocket to the app through the tunnel, which moves to the next tunnel when one drops."""

    resume: str  # the id the route gave it
    queue: asyncio.Queue[tunnel.Frame]  # frames from the route
    stream: int | None = None  # its stream on the tunnel now; None while the tunnel is away
    upstream: Any = None
    subprotocol: str | None = None
    outbox: tunnel.Outbox = field(default_factory=tunnel.Outbox)
    received: int = 0  # messages received from the route
    detached_at: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # sends, in order, also across a resume


class AppTunnel:
    """One app run's tunnel. `run()` lasts until the run ends (the task cancels it) or the plane refuses
    the tunnel."""

    def __init__(
        self,
        *,
        url: str,
        credentials: dict[str, str],
        task_id: str,
        lease_id: str,
        app: AppSpec,
        locate: Locate,
        fail: Fail,
        say: Say,
    ) -> None:
        self.url, self.task_id, self.lease_id, self.app = url, task_id, lease_id, app
        self.credentials = credentials  # Authorization and X-Klique-Instance
        self.locate, self.fail, self.say = locate, fail, say
        self.upstream = Upstream(app.port or 0)  # where the app is, once `locate` has found it
        self.streams: dict[int, asyncio.Queue[tunnel.Frame]] = {}
        self.credit: dict[int, asyncio.Semaphore] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.websockets: dict[str, _Websocket] = {}  # by the id the route gave each
        self.websocket_tasks: set[asyncio.Task[None]] = set()
        self.socket: Any = None
        self.client: httpx.AsyncClient | None = None

    async def run(self) -> None:
        located = await self.locate()
        if located is None:
            return  # the run ended before its app started: its result says how
        self.upstream = located
        try:
            async with httpx.AsyncClient(
                transport=located.transport(), timeout=httpx.Timeout(None, connect=10), follow_redirects=False
            ) as client:
                self.client = client
                problem = await self._wait_healthy() or located.exposure()
                if problem:
                    await self.fail(problem)
                    return
                await self.say(f"klique: the app answers on {located.describe()}; its route is open")
                try:
                    await self._connect_forever()
                finally:
                    for task in list(self.websocket_tasks):
                        task.cancel()
        finally:
            await located.aclose()

    async def _wait_healthy(self) -> str:
        """ "" once the app answers its health check (any answer below 500), else why it did not."""
        assert self.client is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.app.startup_seconds
        last = "it did not answer"
        while loop.time() < deadline:
            try:
                answer = await self.client.get(self.upstream.local + self.app.health_path, timeout=5)
                if answer.status_code < 500:
                    return ""
                last = f"it answered {answer.status_code}"
            except httpx.HTTPError as error:
                last = f"it did not answer ({type(error).__name__})"
            await asyncio.sleep(HEALTH_EVERY)
        return (
            f"the app did not answer its health check (GET {self.app.health_path} on "
            f"{self.upstream.describe()}) within {self.app.startup_seconds} s: {last}"
        )

    async def _connect_forever(self) -> None:
        address, connect_to = tunnel_address(self.url)
        headers = {**self.credentials, "X-Klique-Task": self.task_id, "X-Klique-Lease": self.lease_id}
        delay = 0.5
        while True:
            try:
                async with websockets.connect(
                    address,
                    additional_headers=headers,
                    max_size=tunnel.MAX_FRAME,
                    open_timeout=10,
                    **connect_to,
                ) as socket_:
                    self.socket = socket_
                    await self._serve(socket_)
                    delay = 0.5  # served until the plane went away: back soon
            except websockets.ConnectionClosed as closed:
                if closed.rcvd is not None and closed.rcvd.code in REFUSED_BY_PLANE:
                    logger.info("app %s: the plane closed its route (%s)", self.task_id, closed.rcvd.reason)
                    return
                logger.warning("app %s: its tunnel closed (%s); reconnecting", self.task_id, closed)
            except (OSError, websockets.WebSocketException, TimeoutError) as error:
                logger.warning("app %s: its tunnel could not connect (%s); retrying", self.task_id, error)
            finally:
                self.socket = None
                self._drop_streams()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 15.0)

    def _drop_streams(self) -> None:
        """The tunnel dropped: its requests are given up; its websockets wait for the route to resume them."""
        for task in list(self.tasks):
            task.cancel()
        self.streams.clear()
        self.credit.clear()
        now = asyncio.get_running_loop().time()
        for socket_ in self.websockets.values():
            if socket_.stream is not None:
                socket_.stream, socket_.detached_at = None, now

    async def _serve(self, socket_: Any) -> None:
        async for raw in socket_:
            if isinstance(raw, str):
                continue
            try:
                item = tunnel.Frame.decode(raw)
            except tunnel.FrameError as error:
                logger.warning("app %s: a frame from the plane was refused: %s", self.task_id, error)
                continue
            if item.kind == tunnel.OPEN:
                self._open(item)
            elif item.kind == tunnel.CREDIT and item.stream in self.credit:
                with contextlib.suppress(tunnel.FrameError):
                    for _ in range(min(tunnel.credit_count(item), tunnel.WINDOW)):
                        self.credit[item.stream].release()
            elif item.stream in self.streams:
                await self.streams[item.stream].put(item)

    def _open(self, item: tunnel.Frame) -> None:
        try:
            head = item.document()
            headers = tunnel.headers(head.get("headers", []))
        except tunnel.FrameError as error:
            self._spawn(self._send(tunnel.frame(item.stream, tunnel.RESET, {"reason": str(error)})))
            return
        resume = head.get("resume")
        if head.get("websocket") and "received" in head:
            self._spawn(self._resume(item.stream, resume, head.get("received")))
            return
        self.streams[item.stream] = asyncio.Queue()
        self.credit[item.stream] = asyncio.Semaphore(tunnel.WINDOW)
        if head.get("websocket"):
            socket_ = _Websocket(resume if isinstance(resume, str) else "", self.streams[item.stream])
            socket_.stream = item.stream
            if socket_.resume:
                self.websockets[socket_.resume] = socket_
            # Not one of the tunnel's tasks: it outlives a tunnel.
            task = asyncio.ensure_future(self._websocket(socket_, head, headers))
            self.websocket_tasks.add(task)
            task.add_done_callback(lambda done: self._forget_websocket(socket_, done))
            return
        self._spawn(self._finally_forget(item.stream, self._http(item.stream, head, headers)))

    async def _resume(self, stream: int, resume: object, received: object) -> None:
        """The route opens a websocket again on this tunnel: answer with what this side received, then
        send again what the route did not."""
        socket_ = self.websockets.get(resume) if isinstance(resume, str) else None
        counted = isinstance(received, int) and not isinstance(received, bool)
        if socket_ is not None and counted:
            async with socket_.lock:  # nothing the app sends slips between what is sent again and after
                missed = socket_.outbox.after(received) if socket_.stream is None else None  # type: ignore[arg-type]
                if missed is not None:
                    socket_.stream = stream
                    self.streams[stream] = socket_.queue
                    answer = {"status": 101, "subprotocol": socket_.subprotocol, "received": socket_.received}
                    await self._send(tunnel.frame(stream, tunnel.HEAD, answer))
                    for kind, payload in missed:
                        await self._send(tunnel.Frame(stream, kind, payload).encode())
                    return
        await self._send(tunnel.frame(stream, tunnel.RESET, {"reason": "the websocket cannot be resumed"}))

    def _forget_websocket(self, socket_: _Websocket, task: asyncio.Task[None]) -> None:
        self.websocket_tasks.discard(task)
        if self.websockets.get(socket_.resume) is socket_:
            del self.websockets[socket_.resume]
        if socket_.stream is not None and self.streams.get(socket_.stream) is socket_.queue:
            del self.streams[socket_.stream]

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _finally_forget(self, stream: int, work: Awaitable[None]) -> None:
        try:
            await work
        finally:
            self.streams.pop(stream, None)
            self.credit.pop(stream, None)

    async def _send(self, data: bytes) -> None:
        if self.socket is not None:
            await self.socket.send(data)

    async def _body(self, stream: int) -> AsyncIterator[bytes]:
        queue = self.streams[stream]
        while True:
            item = await queue.get()
            if item.kind == tunnel.DATA:
                yield item.payload
            elif item.kind == tunnel.END:
                return
            else:
                raise ConnectionAbortedError("the client gave up the request")

    async def _http(self, stream: int, head: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
        assert self.client is not None
        target = str(head.get("target") or "/")
        if not target.startswith("/"):
            target = "/" + target
        body = self._body(stream)
        if not head.get("body"):
            async for _ in body:  # no body: only its END
                pass
        request = self.client.build_request(
            str(head.get("method") or "GET"),
            self.upstream.local + target,
            headers=[*headers, (b"origin", self.upstream.local.encode())],  # the route checked the real one
            content=body if head.get("body") else None,
        )
        try:
            answer = await self.client.send(request, stream=True)
        except (httpx.HTTPError, ConnectionAbortedError) as error:
            where = self.upstream.describe()
            reason = f"the app on {where} did not take the request ({type(error).__name__})"
            await self._send(tunnel.frame(stream, tunnel.RESET, {"reason": reason}))
            return
        try:
            passed = [
                [name, value] for name, value in answer.headers.multi_items()
                if name.lower().encode() not in tunnel.HOP_BY_HOP
            ]  # fmt: skip
            await self._send(
                tunnel.frame(stream, tunnel.HEAD, {"status": answer.status_code, "headers": passed})
            )
            credit = self.credit[stream]
            async for chunk in answer.aiter_raw(tunnel.MAX_CHUNK):
                await credit.acquire()
                await self._send(tunnel.frame(stream, tunnel.DATA, chunk))
            await self._send(tunnel.frame(stream, tunnel.END))
        except httpx.HTTPError as error:
            reason = f"the app broke off its answer ({type(error).__name__})"
            await self._send(tunnel.frame(stream, tunnel.RESET, {"reason": reason}))
        finally:
            await answer.aclose()

    async def _websocket(
        self, socket_: _Websocket, head: dict[str, Any], headers: list[tuple[bytes, bytes]]
    ) -> None:
        stream = socket_.stream
        assert stream is not None
        target = str(head.get("target") or "/")
        protocols = [
            part.strip() for name, value in headers if name == b"sec-websocket-protocol"
            for part in value.decode("latin-1").split(",") if part.strip()
        ]  # fmt: skip
        passed = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in headers
            if name not in (b"sec-websocket-protocol", b"x-forwarded-host")
        ]
        passed.append(("Origin", self.upstream.local))
        try:
            upstream = await self.upstream.websocket(
                f"ws://127.0.0.1:{self.upstream.port}{target if target.startswith('/') else '/' + target}",
                additional_headers=passed,
                subprotocols=protocols or None,
                max_size=tunnel.MAX_MESSAGE,
                open_timeout=10,
            )
        except (OSError, websockets.WebSocketException, TimeoutError) as error:
            await self._send(
                tunnel.frame(stream, tunnel.RESET, {"reason": f"the app refused the websocket ({error})"})
            )
            return
        socket_.upstream, socket_.subprotocol = upstream, upstream.subprotocol
        async with upstream:
            async with socket_.lock:
                await self._send(
                    tunnel.frame(stream, tunnel.HEAD, {"status": 101, "subprotocol": upstream.subprotocol})
                )
            down = asyncio.ensure_future(self._websocket_down(socket_))
            try:
                await self._websocket_up(socket_, down)
            except websockets.ConnectionClosed:
                return
            finally:
                down.cancel()

    async def _websocket_up(self, socket_: _Websocket, down: asyncio.Future[None]) -> None:
        """The route's messages to the app, until the route closes, or the app did and the route has its
        close (its END, which a resume sends again if the tunnel drops first), or the tunnel stays away
        too long."""
        loop = asyncio.get_running_loop()
        app_closed_at: float | None = None
        while True:
            if app_closed_at is None and down.done():
                app_closed_at = loop.time()
            try:
                item = await asyncio.wait_for(socket_.queue.get(), 1.0)
            except TimeoutError:
                now = loop.time()
                if socket_.stream is None and now - socket_.detached_at > tunnel.RESUME_SECONDS:
                    logger.info("app %s: a websocket was not resumed; closing it", self.task_id)
                    return
                if (
                    app_closed_at is not None
                    and socket_.stream is not None
                    and now - app_closed_at > CLOSE_SECONDS
                ):
                    return  # the route never said it has the close: it is gone
                continue
            if item.kind in (tunnel.TEXT, tunnel.DATA):
                socket_.received += 1
                if not down.done():
                    await socket_.upstream.send(
                        item.payload.decode(errors="replace") if item.kind == tunnel.TEXT else item.payload
                    )
                if socket_.received % tunnel.ACK_EVERY == 0 and socket_.stream is not None:
                    await self._send(tunnel.ack(socket_.stream, socket_.received))
            elif item.kind == tunnel.ACK:
                with contextlib.suppress(tunnel.FrameError):
                    socket_.outbox.acknowledged(tunnel.ack_count(item))
            else:  # END or RESET: the client is gone, or has the app's close
                return

    async def _websocket_down(self, socket_: _Websocket) -> None:
        """The app's messages to the route; kept until acknowledged, to send again after a resume."""
        upstream = socket_.upstream
        try:
            async for message in upstream:
                kind = tunnel.TEXT if isinstance(message, str) else tunnel.DATA
                await self._to_route(socket_, kind, message.encode() if isinstance(message, str) else message)
        except websockets.ConnectionClosed:
            pass
        code = upstream.close_code or 1000
        with contextlib.suppress(websockets.WebSocketException):
            await self._to_route(socket_, tunnel.END, json.dumps({"code": code}).encode())

    async def _to_route(self, socket_: _Websocket, kind: int, payload: bytes) -> None:
        async with socket_.lock:
            socket_.outbox.record(kind, payload)
            if socket_.stream is not None:
                with contextlib.suppress(websockets.WebSocketException):
                    await self._send(tunnel.Frame(socket_.stream, kind, payload).encode())
