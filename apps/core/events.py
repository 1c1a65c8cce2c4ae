"""Tenant events pushed to websocket clients (the portal, `klique` watchers) after the change commits."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection, transaction
from django.utils import timezone

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)


def events_group(schema_name: str) -> str:
    return f"events.{schema_name}"


def logs_group(schema_name: str, task_id: str) -> str:
    return f"logs.{schema_name}.{task_id}"


def publish_log(*, tenant: Tenant, task_id: str, chunk: dict[str, Any]) -> None:
    """Send a task's new output (or its end) to whoever follows its logs, once the transaction commits."""
    group = logs_group(tenant.schema_name, task_id)

    def send() -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            async_to_sync(layer.group_send)(group, {"type": "task.log", "chunk": chunk})
        except Exception:
            logger.warning("could not publish a log chunk", exc_info=True)

    transaction.on_commit(send)


def publish_event(*, tenant: Tenant, kind: str, data: dict[str, Any]) -> None:
    """Send `kind` with `data` to every websocket client of `tenant` once the current transaction commits."""
    _publish(tenant.schema_name, kind, data)


def publish_here(*, kind: str, data: dict[str, Any]) -> None:
    """publish_event for the tenant whose schema is in use (code that holds a task, not its tenant)."""
    _publish(connection.schema_name, kind, data)  # type: ignore[attr-defined]


def _publish(schema_name: str, kind: str, data: dict[str, Any]) -> None:
    event = {"type": "event", "kind": kind, "data": data, "at": timezone.now().isoformat()}
    group = events_group(schema_name)

    def send() -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        try:
            async_to_sync(layer.group_send)(group, {"type": "event.message", "event": event})
        except Exception:
            # The change itself is committed; a client that misses the push sees it on its next read.
            logger.warning("could not publish event", extra={"event_kind": kind}, exc_info=True)

    transaction.on_commit(send)
