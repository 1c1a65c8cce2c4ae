"""The ASGI entry point that `klique web` serves: Django for HTTP, the LLM gateway for /v1/, the MCP server
for /mcp (and its OAuth metadata), Channels consumers for websockets."""

from __future__ import annotations

import os
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")
django.setup(set_prefix=False)  # what django.core.asgi.get_asgi_application does first

# Imported after Django is set up: the routing pulls in consumers that touch models.
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from apps.core.handlers import SyncChainASGIHandler  # noqa: E402

# Django's handler, with middleware and view in one thread hop (apps.core.handlers says why).
django_application = SyncChainASGIHandler()

from apps.catalogue.route import AppRoute, is_app_host  # noqa: E402
from apps.mcp.asgi import METADATA_PATHS, McpApp  # noqa: E402
from apps.mcp.asgi import PATH as MCP_PATH  # noqa: E402
from config.routing import websocket_urlpatterns  # noqa: E402
from gateway.app import GatewayApp  # noqa: E402

gateway_application = GatewayApp()
mcp_application = McpApp()
app_route = AppRoute()
websocket_application = URLRouter(websocket_urlpatterns)


async def http_application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The LLM gateway answers OpenAI's paths (/v1/...) itself, lean, and the MCP server /mcp; Django answers
    everything else; an app's own host is the internal route's (apps.catalogue.route)."""
    path = scope["path"]
    if is_app_host(scope):
        await app_route(scope, receive, send)
    elif path.startswith("/v1/"):
        await gateway_application(scope, receive, send)
    elif path in (MCP_PATH, f"{MCP_PATH}/") or path in METADATA_PATHS:
        await mcp_application(scope, receive, send)
    else:
        await django_application(scope, receive, send)


async def websocket_router(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Websockets of an app's host go through its route; the rest are Klique's own consumers."""
    if is_app_host(scope):
        await app_route(scope, receive, send)
    else:
        await websocket_application(scope, receive, send)


application = ProtocolTypeRouter({"http": http_application, "websocket": websocket_router})
