"""Who opened a websocket: its tenant from the Host header and its user from a bearer token (or, for the
portal's own pages, the session cookie); and the tenant's events stream. Consumers do all database work
inside the tenant's schema, named explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from http.cookies import SimpleCookie
from importlib import import_module
from typing import Any
from urllib.parse import urlsplit

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.accounts.services import TokenRejected, token_authenticate
from apps.core.events import events_group
from apps.core.websocket import DirectDispatch, WebsocketRejected, header
from tenants.selectors import tenant_for_host


@dataclass(frozen=True)
class WebsocketIdentity:
    schema_name: str
    tenant_slug: str
    user_id: str
    username: str


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


class EventsConsumer(DirectDispatch, AsyncJsonWebsocketConsumer):
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

    async def event_messages(self, message: dict[str, Any]) -> None:
        """The events of one transaction (apps.core.events), each sent as it would be alone, in order."""
        for event in message["events"]:
            await self.send_json(event)
