"""Every websocket, for every kind of caller: the tenant's roles read the events, a task's submitter and
the admins its logs; no
token, another tenant's token, an agent token on a user stream and a user token on the agents' stream
are refused with a close code and a sentence."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.db import connections

from apps.core.events import events_group
from config.asgi import application
from tests.world import HOST_A, HOST_B, World

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _close_consumer_connections() -> Iterator[None]:
    yield
    asyncio.run(sync_to_async(connections.close_all)())


def first_message(path: str, token: str | None, host: str = HOST_A) -> tuple[dict[str, Any], Any]:
    async def scenario() -> tuple[dict[str, Any], Any]:
        headers = [(b"host", host.encode())]
        if token:
            headers.append((b"authorization", f"Bearer {token}".encode()))
        client = WebsocketCommunicator(application, path, headers=headers)
        connected, code = await client.connect()
        if not connected:
            return {}, code
        if await client.receive_nothing(timeout=1):  # accepted and quiet: a queued task's log is empty
            message: dict[str, Any] = {"type": "open"}
        else:
            message = await client.receive_json_from(timeout=5)
        closed = await client.receive_output(timeout=2) if message.get("type") == "error" else None
        await client.disconnect()
        return message, closed

    return asyncio.run(scenario())


STREAMS = ["/ws/v1/events/", "task-logs"]


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("persona", ["dave", "bob", "carol", "alice"])
def test_every_role_of_the_tenant_reads_its_streams(world: World, stream: str, persona: str) -> None:
    """The events are the tenant's; a task's output is its submitter's (bob) and the admins' (alice)."""
    path = f"/ws/v1/tasks/{world.task_a}/logs/" if stream == "task-logs" else stream
    message, closed = first_message(path, world.tokens[persona])
    if stream == "task-logs" and persona in ("dave", "carol"):
        assert message == {"type": "error", "detail": "Only bob and tenant admins read what this task wrote."}
        assert closed == {"type": "websocket.close", "code": 4403}
        return
    assert message["type"] in {"welcome", "open"}, message
    assert closed is None


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize(
    ("caller", "fragment"),
    [
        (None, "Authorization: Bearer"),
        ("charlie", "belongs to another tenant"),
        ("agent", "Malformed token"),
    ],
)
def test_callers_without_a_tenant_users_token_are_refused(
    world: World, stream: str, caller: str | None, fragment: str
) -> None:
    path = f"/ws/v1/tasks/{world.task_a}/logs/" if stream == "task-logs" else stream
    token = world.agent_secret_a if caller == "agent" else (world.tokens[caller] if caller else None)
    message, closed = first_message(path, token)
    assert message["type"] == "error"
    assert fragment in message["detail"], message
    assert closed == {"type": "websocket.close", "code": 4401}


@pytest.mark.parametrize("persona", ["dave", "bob", "alice"])
def test_the_agents_stream_takes_agent_tokens_only(world: World, persona: str) -> None:
    message, closed = first_message("/agents/ws/", world.tokens[persona])
    assert message == {
        "type": "error",
        "detail": "Malformed agent token: expected kqa_<prefix>_<secret>, as issued for the pool.",
        "about": "connect",
    }
    assert closed == {"type": "websocket.close", "code": 4401}


def test_a_task_of_another_tenant_is_not_there(world: World) -> None:
    """charlie, at his own tenant's address, asks for acme's task: it does not exist there."""
    message, closed = first_message(f"/ws/v1/tasks/{world.task_a}/logs/", world.tokens["charlie"], HOST_B)
    assert message == {"type": "error", "detail": "No such task in this tenant."}
    assert closed == {"type": "websocket.close", "code": 4404}


def test_an_event_reaches_its_readers_while_the_database_thread_is_busy(world: World) -> None:
    """Channels made a trip through the database thread before each message a consumer took: every event
    for every open page waited behind the process's database work (the agents' reports among it)."""

    async def scenario() -> tuple[dict[str, Any], bool]:
        headers = [(b"host", HOST_A.encode()), (b"authorization", f"Bearer {world.tokens['alice']}".encode())]
        client = WebsocketCommunicator(application, "/ws/v1/events/", headers=headers)
        assert (await client.connect())[0]
        assert (await client.receive_json_from(timeout=5))["type"] == "welcome"
        release = threading.Event()
        held = asyncio.ensure_future(sync_to_async(release.wait)())
        event = {"type": "event", "kind": "task.running", "data": {"id": "x"}, "at": "now"}
        await get_channel_layer().group_send(events_group("acme"), {"type": "event.message", "event": event})
        try:
            received = await client.receive_json_from(timeout=3)
        finally:
            waited = not held.done()
            release.set()
            await held
        await client.disconnect()
        return received, waited

    received, waited = asyncio.run(scenario())
    assert waited  # the thread was still held when the event arrived
    assert (received["type"], received["kind"], received["data"]) == ("event", "task.running", {"id": "x"})
