"""`/mcp` and its OAuth protected-resource metadata, as a plain ASGI app in front of Django (config/asgi.py
sends them here), like the LLM gateway.

Every request is authenticated before the MCP SDK sees it: the tenant its Host serves, and the Klique
token it bears (apps.mcp.identity). Without a usable token the answer is 401 with the `WWW-Authenticate`
header the MCP specification asks for, naming the resource metadata (RFC 9728) where a client learns which
authorization server the tenant uses. The MCP server runs stateless (streamable HTTP, JSON answers): any
web process answers any request, so `/mcp` scales with them. The SDK's session manager needs a task
group, which Starlette's lifespan would give it; `klique web` runs without lifespan events, so it is
started on the first request, on the serving loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from channels.db import database_sync_to_async
from mcp.server.transport_security import TransportSecuritySettings

from apps.mcp import server as mcp_server
from apps.mcp.identity import NotServed, identity_for
from apps.mcp.metadata import protected_resource

log = logging.getLogger("klique.mcp")

Scope = dict[str, Any]
PATH = "/mcp"
METADATA_PATHS = ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp")
MAX_BODY = 1024 * 1024  # a tool call's arguments; larger requests are refused before they are read


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def origin(scope: Scope) -> str:
    """The address the client used, as the proxy in front says it (`klique web` runs --proxy-headers)."""
    host = _header(scope, b"host") or "localhost"
    return f"{scope.get('scheme', 'http')}://{host}"


class McpApp:
    def __init__(self) -> None:
        self.server = mcp_server.build()
        # The tenant is found by Host, and an unknown Host is refused before the SDK is reached; the SDK's
        # own Host and Origin lists (DNS rebinding protection for servers on localhost) would refuse every
        # tenant's address.
        self.http = self.server.streamable_http_app(
            streamable_http_path=PATH,
            stateless_http=True,
            json_response=True,
            max_request_body_size=MAX_BODY,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        self._running: asyncio.Future[None] | None = None
        self._holder: asyncio.Task[None] | None = None  # held: the loop keeps only a weak reference

    async def _start(self) -> None:
        """The SDK's session manager, started once, on the loop that serves the first request, and running
        for as long as that loop serves (the SDK runs it once per server)."""
        if self._running is not None:
            await self._running
            return
        ready = self._running = asyncio.get_running_loop().create_future()

        async def hold() -> None:
            try:
                async with self.server.session_manager.run():
                    ready.set_result(None)
                    await asyncio.Event().wait()  # until the process stops
            except Exception as error:  # a manager that does not start fails the requests, never hangs them
                if not ready.done():
                    ready.set_exception(error)
                raise

        self._holder = asyncio.get_running_loop().create_task(hold(), name="mcp-session-manager")
        await ready

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        host = _header(scope, b"host").split(":")[0].lower()
        if scope["path"] in METADATA_PATHS:
            await self._metadata(scope, send, host)
            return
        scheme, _, presented = _header(scope, b"authorization").partition(" ")
        token = presented.strip() if scheme.lower() == "bearer" else ""
        try:
            identity = await database_sync_to_async(identity_for)(
                host=host, presented=token, origin=origin(scope)
            )
        except NotServed as refused:
            await self._refuse(scope, send, refused)
            return
        await self._start()
        await self.http({**scope, mcp_server.SCOPE_KEY: identity}, receive, send)

    async def _refuse(self, scope: Scope, send: Any, refused: NotServed) -> None:
        headers = [(b"content-type", b"application/json")]
        if refused.status == 401:
            challenge = f'Bearer resource_metadata="{origin(scope)}{METADATA_PATHS[1]}"'
            if refused.invalid_token:
                description = str(refused).replace('"', "'")
                challenge += f', error="invalid_token", error_description="{description}"'
            headers.append((b"www-authenticate", challenge.encode()))
        body = json.dumps({"error": str(refused)}).encode()
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": refused.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _metadata(self, scope: Scope, send: Any, host: str) -> None:
        status, document = await database_sync_to_async(protected_resource)(host=host, origin=origin(scope))
        body = json.dumps(document).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
