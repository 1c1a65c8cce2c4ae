"""Websocket routes. Each consumer resolves its tenant from the Host header (apps.accounts.consumers)."""

from __future__ import annotations

from django.urls import path

from apps.accounts.consumers import EventsConsumer
from apps.catalogue.tunnel import TunnelConsumer
from apps.fleet.consumers import AgentConsumer
from apps.fleet.log_follower import TaskLogsConsumer

websocket_urlpatterns = [
    path("ws/v1/events/", EventsConsumer.as_asgi()),
    path("ws/v1/tasks/<uuid:task_id>/logs/", TaskLogsConsumer.as_asgi()),
    path("agents/ws/", AgentConsumer.as_asgi()),
    path("agents/tunnel/", TunnelConsumer.as_asgi()),
]
