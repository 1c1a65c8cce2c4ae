"""The plane's end of an app's tunnel (/agents/tunnel/): the websocket an agent opens, outbound, for one app
it runs once the app answers its health check (protocol.tunnel has the frames).

The agent presents its pool's agent token, the instance key the token is bound to, and the task and lease
of the app's run: a tunnel is fenced by its lease like every report, so only the live run of the app,
by the agent that runs it, can serve its route. The consumer's channel is recorded on the app; the route
(apps.catalogue.route), in whichever web process, sends each request to that channel over the channel
layer and reads the answer from a channel of its own. Streams are numbered here.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.db import DatabaseError, close_old_connections
from django_tenants.utils import schema_context

from apps.catalogue import services
from apps.catalogue.admissions import ADMISSIONS
from apps.core.errors import NotFound
from apps.core.tunnels import ACCEPTED, DROPPED
from apps.core.websocket import DirectDispatch, header
from apps.fleet import credentials, errors
from protocol import tunnel

logger = logging.getLogger(__name__)

CLOSE_TOKEN, CLOSE_NOT_SERVED, CLOSE_UNAVAILABLE = 4401, 4404, 1011


class TunnelConsumer(DirectDispatch, AsyncWebsocketConsumer):
    schema_name = ""
    app_id: Any = None

    async def connect(self) -> None:
        self.streams: dict[int, str] = {}  # stream -> the route's reply channel
        self.by_reply: dict[str, int] = {}
        self.ended: dict[int, set[str]] = {}  # which sides of a stream said END
        self.next_stream = 1
        try:
            self.schema_name, self.app_id = await database_sync_to_async(self._open)()
        except (errors.AgentRejected, NotFound) as refused:
            await self.accept()
            code = CLOSE_TOKEN if isinstance(refused, errors.AgentRejected) else CLOSE_NOT_SERVED
            await self.close(code=code, reason=str(refused)[:120])
            return
        except DatabaseError as error:
            logger.warning("app tunnel refused: the database is unavailable (%s)", error)
            await self.close(code=CLOSE_UNAVAILABLE)
            return
        await self.accept()

    def _open(self) -> tuple[str, Any]:
        try:
            tenant, token = credentials.agent_at_handshake(
                host=header(self.scope, b"host"), authorization=header(self.scope, b"authorization")
            )
            with schema_context(tenant.schema_name):
                if not credentials.is_bound_to(token, header(self.scope, b"x-klique-instance")):
                    raise errors.AgentRejected("This agent token is bound to another agent; say hello first.")
                app = services.tunnel_open(
                    pool_id=token.pool_id,
                    agent_id=token.bound_agent_id,
                    task_id=header(self.scope, b"x-klique-task"),
                    lease_id=header(self.scope, b"x-klique-lease"),
                    channel=self.channel_name,
                )
            return tenant.schema_name, app.pk
        except (ValueError, TypeError):  # an id that is not one: the same as one of no app
            raise NotFound("The task or lease named is not an app of this agent.") from None
        finally:
            close_old_connections()

    async def disconnect(self, code: int) -> None:
        ADMISSIONS.forget(self.channel_name)
        for reply in list(self.by_reply):
            await self._to_route(reply, tunnel.RESET, DROPPED)
        if self.app_id is not None:
            with contextlib.suppress(DatabaseError):
                await database_sync_to_async(self._closed)()

    def _closed(self) -> None:
        try:
            with schema_context(self.schema_name):
                services.tunnel_closed(app_id=self.app_id, channel=self.channel_name)
        finally:
            close_old_connections()

    # From the route -------------------------------------------------------------------------------------

    async def tunnel_open(self, event: dict[str, Any]) -> None:
        reply = event["reply"]
        stream, self.next_stream = self.next_stream, self.next_stream + 1
        self.streams[stream], self.by_reply[reply], self.ended[stream] = reply, stream, set()
        await self._to_route(reply, ACCEPTED, b"")
        await self._to_agent(stream, tunnel.frame(stream, tunnel.OPEN, event["head"]))

    async def tunnel_frame(self, event: dict[str, Any]) -> None:
        stream = self.by_reply.get(event["reply"])
        if stream is None:
            return
        kind = event["kind"]
        if await self._to_agent(stream, tunnel.Frame(stream, kind, event.get("payload") or b"").encode()):
            self._ended(stream, kind, "route")

    async def _to_agent(self, stream: int, data: bytes) -> bool:
        """Send a frame to the agent; where its socket is gone already (the agent killed a moment ago, its
        close not seen yet), the route is told at once and the stream forgotten, rather than left waiting
        for an answer that cannot come. The disconnect that follows does the rest."""
        try:
            await self.send(bytes_data=data)
        except Exception as error:  # whatever the server raises for a socket that is gone
            logger.info("app %s: a frame for its agent could not be sent (%s)", self.app_id, error)
            reply = self.streams.get(stream)
            if reply is not None:
                await self._to_route(reply, tunnel.RESET, DROPPED)
                self._ended(stream, tunnel.RESET, "route")
            return False
        return True

    def _ended(self, stream: int, kind: int, side: str) -> None:
        if kind == tunnel.END:
            self.ended[stream].add(side)
        if kind == tunnel.RESET or len(self.ended.get(stream, ())) == 2:
            reply = self.streams.pop(stream, None)
            self.ended.pop(stream, None)
            if reply is not None:
                self.by_reply.pop(reply, None)

    # From the agent -------------------------------------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if bytes_data is None:
            return
        try:
            item = tunnel.Frame.decode(bytes_data)
        except tunnel.FrameError as error:
            logger.warning("app %s: a tunnel frame was refused: %s", self.app_id, error)
            return
        reply = self.streams.get(item.stream)
        if reply is None or item.kind in (tunnel.OPEN, tunnel.CREDIT):
            return  # a stream the route gave up, or a frame only the plane sends
        await self._to_route(reply, item.kind, item.payload)
        self._ended(item.stream, item.kind, "agent")

    async def _to_route(self, reply: str, kind: int, payload: bytes) -> None:
        try:
            await self.channel_layer.send(reply, {"type": "route.frame", "kind": kind, "payload": payload})
        except Exception as error:  # the channel layer away: the route times out and says so
            logger.warning("app %s: a frame for the route was lost (%s)", self.app_id, error)
