"""The agent's end of an app's relay: the app runs on another machine (a compute node of an HPC pool, a
pod of a Kubernetes pool) behind a relay (agents.node.AppRelay) that leads to it only for a caller who
first sends the run's app key (`HELLO` + key + newline, answered with `ANSWER`). The key is made by the
agent for each run, so only the agent (and the run itself) can reach the app: anyone else who finds the
relay's port gets a closed connection.

`NodeRelay` answers the tunnel's requests through a Unix socket of the agent's own (in a folder only the
agent reads), each connection to which is a connection to the app through the relay. It sends a request
on only once the far end has answered the handshake, so an address that names another service gets one
line of text from the agent and nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
from pathlib import Path
from typing import Any

import httpx
import websockets

from agents.tunnel import Upstream

HELLO = b"KLIQUE-APP/1 "  # + the key (64 hex digits) + b"\n"; the node reporter has the same words
ANSWER = b"KLIQUE-APP/1 OK\n"
HANDSHAKE_SECONDS = 10.0
CHUNK = 64 * 1024


def new_key() -> str:
    return secrets.token_hex(32)


def hello(key: str) -> bytes:
    return HELLO + key.encode() + b"\n"


async def reach(host: str, port: int, key: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the app through the node's relay, after its handshake; ConnectionError if the far
    end is not the relay of this run (or the app behind it does not answer)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), HANDSHAKE_SECONDS)
    try:
        writer.write(hello(key))
        await writer.drain()
        answer = await asyncio.wait_for(reader.readexactly(len(ANSWER)), HANDSHAKE_SECONDS)
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as error:
        writer.close()
        raise ConnectionError(f"the relay on {host}:{port} did not answer ({type(error).__name__})") from None
    if answer != ANSWER:
        writer.close()
        raise ConnectionError(f"{host}:{port} is not this app's relay")
    return reader, writer


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
    except (OSError, RuntimeError):
        pass  # one side went away: the other is closed below


class NodeRelay(Upstream):
    """The agent's end of the way to an app on a compute node: a Unix socket in a folder of the agent's
    own, each connection to which is a connection to the app through the node's relay."""

    def __init__(self, host: str, relay_port: int, app_port: int, key: str, *, place: str = "") -> None:
        super().__init__(app_port)
        self.host, self.relay_port, self.key = host, relay_port, key
        self.place = place or f"node {host}"  # where the app is, in words
        self.folder = Path(tempfile.mkdtemp(prefix="klique-app-"))  # mode 700: the agent's alone
        self.path = str(self.folder / "app.sock")
        self.server: asyncio.Server | None = None
        self.problem = ""  # why the last connection did not reach the app
        self.connections: set[asyncio.StreamWriter] = set()  # both ends of each connection open now
        self.serving: set[asyncio.Task[None]] = set()

    async def open(self) -> NodeRelay:
        self.server = await asyncio.start_unix_server(self._serve, path=self.path)
        return self

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if (task := asyncio.current_task()) is not None:
            self.serving.add(task)
            task.add_done_callback(self.serving.discard)
        self.connections.add(client_writer)
        try:
            reader, writer = await reach(self.host, self.relay_port, self.key)
        except (OSError, TimeoutError) as error:
            self.problem = str(error)
            client_writer.close()
            self.connections.discard(client_writer)
            return
        self.problem = ""
        self.connections.add(writer)
        try:
            await asyncio.gather(_pipe(client_reader, writer), _pipe(reader, client_writer))
        except asyncio.CancelledError:
            pass  # the agent stops; this task is the stream server's, whose 3.11 logs a cancel as an error
        finally:
            for end in (writer, client_writer):
                end.close()
                self.connections.discard(end)

    def describe(self) -> str:
        where = f"port {self.port} of {self.place}"
        return f"{where} ({self.problem})" if self.problem else where

    def exposure(self) -> str:
        """Nothing this agent can see: on a compute node the node reporter looks (agents.node), and a pod
        has a network of its own that admits the relay's port only (protocol.pods)."""
        return ""

    def transport(self) -> httpx.AsyncBaseTransport:
        return httpx.AsyncHTTPTransport(uds=self.path)

    def websocket(self, uri: str, **options: Any) -> Any:
        return websockets.unix_connect(self.path, uri, **options)

    async def aclose(self) -> None:
        """Stop taking connections and end those open (their tasks end by themselves as their ends close)."""
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(OSError):
                await self.server.wait_closed()
        for end in list(self.connections):
            end.close()
        if self.serving:
            await asyncio.wait(list(self.serving), timeout=HANDSHAKE_SECONDS)
        with contextlib.suppress(OSError):
            Path(self.path).unlink()
            self.folder.rmdir()
