"""Websocket consumers. Each resolves its tenant from the Host header and its user from a bearer token,
then does all database work inside that tenant's schema, named explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django_tenants.utils import schema_context

from apps.core.events import events_group


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


def _header(scope: dict[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return ""


def resolve_identity(scope: dict[str, Any]) -> WebsocketIdentity:
    """The tenant and user of a websocket, or WebsocketRejected with a close code and a sentence."""
    from apps.accounts.services import TokenRejected, token_authenticate
    from tenants.selectors import tenant_for_host

    host = _header(scope, b"host").split(":")[0].lower()
    tenant = tenant_for_host(host)
    if tenant is None:
        raise WebsocketRejected(f"No tenant is served at {host!r}; check the address.", 4404)
    if tenant.is_suspended:
        raise WebsocketRejected(f"Tenant {tenant.slug} is suspended: {tenant.suspended_reason}", 4403)
    scheme, _, presented = _header(scope, b"authorization").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise WebsocketRejected("Send 'Authorization: Bearer <token>' when opening the websocket.", 4401)
    with schema_context(tenant.schema_name):
        try:
            user, _ = token_authenticate(tenant=tenant, presented=presented.strip())
        except TokenRejected as rejected:
            raise WebsocketRejected(str(rejected), 4401) from None
    return WebsocketIdentity(tenant.schema_name, tenant.slug, str(user.pk), user.username)


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
