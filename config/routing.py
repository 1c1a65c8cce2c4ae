"""Websocket routes. Each consumer resolves its tenant from the Host header (see apps.core.consumers)."""

from __future__ import annotations

from django.urls import path

from apps.core.consumers import EventsConsumer, TaskLogsConsumer
from apps.fleet.consumers import AgentConsumer

websocket_urlpatterns = [
    path("ws/v1/events/", EventsConsumer.as_asgi()),
    path("ws/v1/tasks/<uuid:task_id>/logs/", TaskLogsConsumer.as_asgi()),
    path("agents/ws/", AgentConsumer.as_asgi()),
]
