"""Websocket consumers. Each resolves its tenant from the Host header and its user from a bearer token,
then does all database work inside that tenant's schema, named explicitly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from http.cookies import SimpleCookie
from importlib import import_module
from typing import Any
from urllib.parse import parse_qs, urlsplit

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.accounts.services import TokenRejected, token_authenticate
from apps.core.events import events_group, logs_group
from apps.fleet.selectors import task_logs
from apps.scheduling.models import Task
from apps.scheduling.selectors import may_read_output, output_readers
from tenants.selectors import tenant_for_host

logger = logging.getLogger(__name__)


class WebsocketRejected(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class WebsocketIdentity:
    schema_name: str
    tenant_slug: str
    user_id: str
    username: str


def header(scope: dict[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return ""


def resolve_identity(scope: dict[str, Any]) -> WebsocketIdentity:
    """The tenant and user of a websocket, or WebsocketRejected with a close code and a sentence."""

    host = header(scope, b"host").split(":")[0].lower()
    tenant = tenant_for_host(host)
    if tenant is None:
        raise WebsocketRejected(f"No tenant is served at {host!r}; check the address.", 4404)
    if tenant.is_suspended:
        raise WebsocketRejected(f"Tenant {tenant.slug} is suspended: {tenant.suspended_reason}", 4403)
    scheme, _, presented = header(scope, b"authorization").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        user = _session_user(scope, tenant.schema_name, host)  # the portal, signed in with a session
        return WebsocketIdentity(tenant.schema_name, tenant.slug, str(user.pk), user.username)
    with schema_context(tenant.schema_name):
        try:
            user, _ = token_authenticate(tenant=tenant, presented=presented.strip())
        except TokenRejected as rejected:
            raise WebsocketRejected(str(rejected), 4401) from None
    return WebsocketIdentity(tenant.schema_name, tenant.slug, str(user.pk), user.username)


def _same_origin(origin: Any, host_header: str) -> bool:
    """The page's origin is this address: the same host and the same port (another service on another
    port of the same host is another origin). A Host without a port means the default port of the page's
    scheme: behind a proxy that ends TLS the socket itself may arrive as plain ws."""

    defaults = {"http": 80, "https": 443}
    asked = urlsplit(f"//{host_header}")
    try:
        origin_port = origin.port or defaults.get(origin.scheme, 0)
        asked_port = asked.port or defaults.get(origin.scheme, 0)
    except ValueError:  # a port that is not a number
        return False
    same_host = bool(origin.hostname) and (origin.hostname or "").lower() == (asked.hostname or "").lower()
    return same_host and origin_port == asked_port


def _session_user(scope: dict[str, Any], schema_name: str, host: str) -> Any:
    """The signed-in user of the session cookie, for pages of this tenant's own address only (another
    site's page must not open a socket with the visitor's cookie)."""

    origin = header(scope, b"origin")
    cookie = SimpleCookie(header(scope, b"cookie")).get(settings.SESSION_COOKIE_NAME)
    if cookie is None:
        raise WebsocketRejected("Send 'Authorization: Bearer <token>' when opening the websocket.", 4401)
    if not origin or not _same_origin(urlsplit(origin), header(scope, b"host")):
        raise WebsocketRejected(
            "A signed-in session opens websockets from its own tenant's pages only.", 4403
        )
    store = import_module(settings.SESSION_ENGINE).SessionStore
    with schema_context(schema_name):
        user_id = store(session_key=cookie.value).get("_auth_user_id")
        user = User.objects.filter(pk=user_id, is_active=True).first() if user_id else None
    if user is None:
        raise WebsocketRejected("The session has ended; sign in again.", 4401)
    return user


LOG_POLL_SECONDS = 2.0  # how often a follower reads the store when no live chunk woke it
ENDED = ("completed", "failed", "aborted")


def _after(scope: dict[str, Any]) -> int:
    """The ?after= cursor the client already has (0: from the start)."""

    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("after", ["0"])
    try:
        return max(0, int(values[-1]))
    except ValueError:
        raise WebsocketRejected("after is the cursor of the last chunk read, a whole number.", 4400) from None


class TaskLogsConsumer(AsyncJsonWebsocketConsumer):
    """Streams one task's output: what it has written after the client's cursor (?after=, from the start
    without one), then each new chunk as its agent reports it, then {"type": "end", "state": ...} when
    the task ends. Same handshake as the events stream.

    The store is the truth and the channel layer only a doorbell: each live message, and a read every
    LOG_POLL_SECONDS when none comes, sends what the store holds after the last cursor sent. So a chunk
    whose live message was lost (Redis restarting) is sent anyway, in order and once, and the end is
    delivered even if its own message never arrives. A client that reconnects with the cursor it has
    gets only what came since."""

    identity: WebsocketIdentity | None = None
    group: str | None = None
    cursor = 0
    task_id = ""
    done = False
    poller: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        await self.accept()
        self.task_id = str(self.scope["url_route"]["kwargs"]["task_id"])
        self.lock = asyncio.Lock()
        try:
            self.cursor = _after(self.scope)
            self.identity = await database_sync_to_async(resolve_identity)(self.scope)
            await database_sync_to_async(self._check_reader)()
        except WebsocketRejected as rejected:
            await self.send_json({"type": "error", "detail": str(rejected)})
            await self.close(code=rejected.code)
            return
        self.group = logs_group(self.identity.schema_name, self.task_id)
        try:
            await self.channel_layer.group_add(self.group, self.channel_name)
        except Exception as error:  # the channel layer down: the store is read on a timer instead
            logger.warning("log follower of task %s without live chunks: %s", self.task_id, error)
            self.group = None
        await self._catch_up()
        if not self.done:
            self.poller = asyncio.create_task(self._poll())

    def _check_reader(self) -> None:
        assert self.identity is not None
        with schema_context(self.identity.schema_name):
            task = Task.objects.select_related("submitter", "project").filter(pk=self.task_id).first()
            if task is None:
                raise WebsocketRejected("No such task in this tenant.", 4404)
            reader = User.objects.filter(pk=self.identity.user_id).first()
            if reader is None or not may_read_output(reader, task):
                raise WebsocketRejected(output_readers(task), 4403)

    def _read(self, after: int) -> tuple[list[dict[str, Any]], str]:
        assert self.identity is not None
        try:
            with schema_context(self.identity.schema_name):
                state = Task.objects.filter(pk=self.task_id).values_list("state", flat=True).first()
                task = Task(pk=self.task_id)
                chunks = [{**chunk, "at": chunk["at"].isoformat()} for chunk in task_logs(task, after=after)]
        finally:
            close_old_connections()
        return chunks, state or ""

    async def _catch_up(self) -> None:
        """Send what the store holds after the last cursor sent, then the end if the task has ended."""
        async with self.lock:
            if self.done:
                return
            chunks, state = await database_sync_to_async(self._read)(self.cursor)
            for chunk in chunks:
                await self.send_json({"type": "log", **chunk})
                self.cursor = max(self.cursor, int(chunk["cursor"]))
            if state in ENDED:
                self.done = True
                await self.send_json({"type": "end", "state": state, "cursor": self.cursor})
                await self.close()

    async def _poll(self) -> None:
        while not self.done:
            await asyncio.sleep(LOG_POLL_SECONDS)
            try:
                await self._catch_up()
            except DatabaseError as error:  # the database restarting: try again on the next tick
                logger.warning("log follower of task %s: the store cannot be read (%s)", self.task_id, error)

    async def disconnect(self, code: int) -> None:
        self.done = True
        if self.poller is not None:
            self.poller.cancel()
        if self.group is not None:
            with contextlib.suppress(Exception):
                await self.channel_layer.group_discard(self.group, self.channel_name)

    async def task_log(self, message: dict[str, Any]) -> None:
        """A live chunk or end: the doorbell to read the store."""
        try:
            await self._catch_up()
        except DatabaseError as error:
            logger.warning("log follower of task %s: the store cannot be read (%s)", self.task_id, error)


class EventsConsumer(AsyncJsonWebsocketConsumer):
    """Streams the tenant's events (see apps.core.events) to any signed-in user of that tenant.

    The server speaks first: `welcome` on success, or `error` with a sentence and then a close with code
    4401 (token), 4403 (suspended tenant) or 4404 (unknown tenant). Clients only listen.
    """

    identity: WebsocketIdentity | None = None

    async def connect(self) -> None:
        await self.accept()
        try:
            self.identity = await database_sync_to_async(resolve_identity)(self.scope)
        except WebsocketRejected as rejected:
            await self.send_json({"type": "error", "detail": str(rejected)})
            await self.close(code=rejected.code)
            return
        await self.channel_layer.group_add(events_group(self.identity.schema_name), self.channel_name)
        await self.send_json(
            {"type": "welcome", "tenant": self.identity.tenant_slug, "user": self.identity.username}
        )

    async def disconnect(self, code: int) -> None:
        if self.identity is not None:
            await self.channel_layer.group_discard(events_group(self.identity.schema_name), self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        await self.send_json(
            {"type": "error", "detail": "This stream is read-only; nothing needs to be sent."}
        )

    async def event_message(self, message: dict[str, Any]) -> None:
        await self.send_json(message["event"])
