"""Tenant events pushed to websocket clients (the portal, `klique` watchers) after the change commits.

Sending never waits on the channel layer: the code that committed (an agent's report on the websocket
loop's path, a request, the scheduling cycle) hands the message to one publisher thread per process, whose
event loop sends group messages in the order they were handed over. A message not yet sent when the
process exits gets up to two seconds."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
from typing import Any, Protocol

from channels.layers import get_channel_layer
from django.db import connection, transaction
from django.utils import timezone


class Tenant(Protocol):
    """What an event needs of its tenant (tenants.models.Tenant): the schema whose clients hear it."""

    schema_name: str


logger = logging.getLogger(__name__)


class _Publisher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0
        self.pending: set[concurrent.futures.Future[None]] = set()

    def loop(self) -> asyncio.AbstractEventLoop:
        """This process's publisher loop (a forked child starts its own)."""
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                self._loop, self._pid = asyncio.new_event_loop(), os.getpid()
                self.pending = set()
                threading.Thread(target=self._loop.run_forever, name="klique-publisher", daemon=True).start()
            return self._loop

    def track(self, future: concurrent.futures.Future[None], *, done: bool = False) -> None:
        with self._lock:
            if done:
                self.pending.discard(future)
            else:
                self.pending.add(future)

    def drain(self, timeout: float = 2.0) -> None:
        with self._lock:
            waiting = list(self.pending)
        concurrent.futures.wait(waiting, timeout=timeout)


_publisher = _Publisher()
atexit.register(_publisher.drain)


def send_to_group(group: str, message: dict[str, Any], *, what: str) -> None:
    """Hand `message` to the publisher for the channel layer's `group`; `what` names it in a warning if
    it cannot be sent (the change is committed: a client that misses the push sees it on its next read)."""
    layer = get_channel_layer()
    if layer is None:
        return
    future = asyncio.run_coroutine_threadsafe(layer.group_send(group, message), _publisher.loop())
    _publisher.track(future)

    def sent(done: concurrent.futures.Future[None]) -> None:
        _publisher.track(done, done=True)
        if not done.cancelled() and done.exception() is not None:
            logger.warning("could not publish %s", what, exc_info=done.exception())

    future.add_done_callback(sent)


def events_group(schema_name: str) -> str:
    return f"events.{schema_name}"


def logs_group(schema_name: str, task_id: str) -> str:
    return f"logs.{schema_name}.{task_id}"


def publish_log(*, tenant: Tenant, task_id: str, chunk: dict[str, Any]) -> None:
    """Send a task's new output (or its end) to whoever follows its logs, once the transaction commits."""
    group = logs_group(tenant.schema_name, task_id)

    transaction.on_commit(
        lambda: send_to_group(group, {"type": "task.log", "chunk": chunk}, what="a log chunk")
    )


def publish_event(*, tenant: Tenant, kind: str, data: dict[str, Any]) -> None:
    """Send `kind` with `data` to every websocket client of `tenant` once the current transaction commits."""
    _publish(tenant.schema_name, kind, data)


def publish_here(*, kind: str, data: dict[str, Any]) -> None:
    """publish_event for the tenant whose schema is in use (code that holds a task, not its tenant)."""
    _publish(connection.schema_name, kind, data)  # type: ignore[attr-defined]


def _publish(schema_name: str, kind: str, data: dict[str, Any]) -> None:
    event = {"type": "event", "kind": kind, "data": data, "at": timezone.now().isoformat()}
    group = events_group(schema_name)
    batch = _pending_batch(group)
    if batch is not None:
        batch.events.append(event)
        return
    batch = _Batch(group)
    batch.events.append(event)
    transaction.on_commit(batch)


class _Batch:
    """The events one transaction publishes to one group (at one savepoint level), sent in one message at
    its commit, in the order they were published: a burst of an agent's messages moves many tasks, and each
    event alone cost the process a trip through the publisher and the channel layer."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.savepoints = set(connection.savepoint_ids)
        self.events: list[dict[str, Any]] = []
        self.sent = False

    def __call__(self) -> None:
        self.sent = True
        message: dict[str, Any] = (
            {"type": "event.message", "event": self.events[0]}
            if len(self.events) == 1
            else {"type": "event.messages", "events": self.events}
        )
        kinds = ", ".join(sorted({str(event["kind"]) for event in self.events}))
        send_to_group(self.group, message, what=f"events {kinds}")


def _pending_batch(group: str) -> _Batch | None:
    """The batch of `group` this transaction will send at its commit, if the last one registered for the
    group was registered at the savepoint level the transaction is at now (rolling a savepoint back drops
    the events published within it, as Django drops the callbacks registered there; and an event never
    joins a batch sent before another batch of its group); None outside a transaction, where an event is
    sent at once."""
    if not connection.in_atomic_block:
        return None
    savepoints = set(connection.savepoint_ids)
    for entry in reversed(connection.run_on_commit):  # (savepoints, callback, robust)
        registered, callback = entry[0], entry[1]
        if isinstance(callback, _Batch) and callback.group == group:
            fits = not callback.sent and registered == savepoints == callback.savepoints
            return callback if fits else None
    return None
