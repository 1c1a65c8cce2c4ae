"""The events websocket: tenant from Host, user from a bearer token, and only that tenant's events."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections
from django_tenants.utils import schema_context

from apps.accounts.models import Project
from apps.accounts.services import project_save
from config.asgi import application
from tests.world import HOST_A, World


@pytest.fixture(autouse=True)
def _close_consumer_connections() -> Iterator[None]:
    """Consumers query from asgiref's long-lived worker thread; close its connection after each test."""
    yield
    asyncio.run(sync_to_async(connections.close_all)())


def communicator(host: str, token: str | None) -> WebsocketCommunicator:
    headers = [(b"host", host.encode())]
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    return WebsocketCommunicator(application, "/ws/v1/events/", headers=headers)


def save_project_and_commit(world: World, schema: str, name: str) -> None:
    """Runs in the consumer's database thread, outside the test's transaction, so it really commits."""
    tenant = world.tenant_a if schema == "acme" else world.tenant_b
    with schema_context(schema):
        project_save(tenant=tenant, name=name)


def delete_projects(names: list[str]) -> None:
    for schema in ("acme", "globex"):
        with schema_context(schema):
            Project.objects.filter(name__in=names).delete()


def test_a_user_receives_their_tenant_s_events_and_no_other(world: World, db: None) -> None:
    names = [f"ws-b-{uuid.uuid4().hex[:6]}", f"ws-a-{uuid.uuid4().hex[:6]}"]

    async def scenario() -> list[dict[str, Any]]:
        client = communicator(HOST_A, world.tokens["bob"])
        connected, _ = await client.connect()
        assert connected
        received = [await client.receive_json_from(timeout=5)]
        try:
            await database_sync_to_async(save_project_and_commit)(world, "globex", names[0])
            await database_sync_to_async(save_project_and_commit)(world, "acme", names[1])
            received.append(await client.receive_json_from(timeout=5))
            assert await client.receive_nothing(timeout=0.3)
        finally:
            await database_sync_to_async(delete_projects)(names)
            await client.disconnect()
        return received

    welcome, event = asyncio.run(scenario())
    assert welcome == {"type": "welcome", "tenant": "acme", "user": "bob"}
    assert event["type"] == "event"
    assert event["kind"] == "project.saved"
    assert event["data"]["name"] == names[1]


@pytest.mark.parametrize(
    ("host", "persona", "code", "fragment"),
    [
        (HOST_A, None, 4401, "Authorization: Bearer"),
        (HOST_A, "charlie", 4401, "belongs to another tenant"),
        ("nowhere.klique.test", "bob", 4404, "No tenant is served"),
    ],
)
def test_refused_connections_say_why(
    world: World, db: None, host: str, persona: str | None, code: int, fragment: str
) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        client = communicator(host, world.tokens[persona] if persona else None)
        connected, _ = await client.connect()
        assert connected
        error = await client.receive_json_from(timeout=5)
        closed = await client.receive_output(timeout=5)
        await client.wait()
        return error, closed

    error, closed = asyncio.run(scenario())
    assert error["type"] == "error"
    assert fragment in error["detail"]
    assert closed == {"type": "websocket.close", "code": code}


def test_a_suspended_tenant_s_websocket_is_refused_with_the_reason(world: World, db: None) -> None:
    from apps.accounts.consumers import resolve_identity
    from apps.core.websocket import WebsocketRejected
    from apps.provider.services import tenant_suspend

    tenant_suspend(tenant=world.tenant_a, reason="Maintenance of the billing system.")
    scope = {
        "headers": [(b"host", HOST_A.encode()), (b"authorization", f"Bearer {world.tokens['bob']}".encode())]
    }
    with pytest.raises(WebsocketRejected, match="Maintenance of the billing system") as rejected:
        resolve_identity(scope)
    assert rejected.value.code == 4403


def test_an_idle_channel_outlives_the_redis_read_timeout(db: None) -> None:
    """A consumer waits on the channel layer longer than redis-py's default 5 s read timeout."""
    from channels.layers import get_channel_layer

    async def scenario() -> dict[str, Any]:
        layer = get_channel_layer()
        channel = await layer.new_channel()

        async def later() -> None:
            await asyncio.sleep(6.5)
            await layer.send(channel, {"type": "late.message"})

        sender = asyncio.create_task(later())
        message: dict[str, Any] = await asyncio.wait_for(layer.receive(channel), timeout=20)
        await sender
        await layer.flush()
        return message

    assert asyncio.run(scenario()) == {"type": "late.message"}


def test_group_messages_handed_to_the_publisher_arrive_in_order(db: None) -> None:
    """send_to_group returns at once (the publisher thread sends); a group member gets every message, in
    the order handed over, and a process waiting at exit would wait for them (drain)."""
    from channels.layers import get_channel_layer

    from apps.core.events import _publisher, send_to_group

    async def scenario() -> list[int]:
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add("klique-order-test", channel)
        for number in range(200):
            send_to_group("klique-order-test", {"type": "n", "n": number}, what="a test message")
        _publisher.drain()
        got = [(await asyncio.wait_for(layer.receive(channel), timeout=10))["n"] for _ in range(200)]
        await layer.group_discard("klique-order-test", channel)
        await layer.flush()
        return got

    assert asyncio.run(scenario()) == list(range(200))


def undo() -> None:
    raise RuntimeError("undone")


def publish_in_savepoints(schema: str) -> None:
    """One committed transaction: events at the top, in a savepoint kept, in one rolled back, and after."""
    from django.db import transaction

    from apps.core.events import publish_here

    with schema_context(schema), transaction.atomic():
        publish_here(kind="batch.test", data={"n": 1})
        publish_here(kind="batch.test", data={"n": 2})
        with transaction.atomic():
            publish_here(kind="batch.test", data={"n": 3})
        publish_here(kind="batch.test", data={"n": 4})
        with contextlib.suppress(RuntimeError), transaction.atomic():
            publish_here(kind="batch.test", data={"n": 5})
            undo()  # the savepoint is rolled back, with what it published
        publish_here(kind="batch.test", data={"n": 6})
    with schema_context(schema), transaction.atomic():
        publish_here(kind="batch.test", data={"n": 7})  # a transaction of one: a message of one


def test_a_transactions_events_arrive_in_order_and_an_undone_savepoints_do_not(
    world: World, db: None
) -> None:
    """The events one transaction publishes go out as few messages (apps.core.events._Batch), and the
    client gets each as before, in the order published, without those of a savepoint rolled back."""
    from channels.layers import get_channel_layer

    from apps.core.events import events_group

    sent: list[dict[str, Any]] = []
    layer = get_channel_layer()
    real_send = layer.group_send

    async def counting(group: str, message: dict[str, Any]) -> None:
        if group == events_group("acme"):
            sent.append(message)
        await real_send(group, message)

    async def scenario() -> list[dict[str, Any]]:
        client = communicator(HOST_A, world.tokens["bob"])
        connected, _ = await client.connect()
        assert connected
        await client.receive_json_from(timeout=5)  # the welcome
        try:
            await database_sync_to_async(publish_in_savepoints)("acme")
            received = [await client.receive_json_from(timeout=5) for _ in range(6)]
            assert await client.receive_nothing(timeout=0.3)
        finally:
            await client.disconnect()
        return received

    layer.group_send = counting
    try:
        received = asyncio.run(scenario())
    finally:
        layer.group_send = real_send
    assert [event["data"]["n"] for event in received] == [1, 2, 3, 4, 6, 7]
    assert all(event["type"] == "event" and event["kind"] == "batch.test" for event in received)
    # [1, 2] at the top; [3] in its savepoint; [4, 6] at the top again; [7] alone.
    assert [m["type"] for m in sent] == ["event.messages", "event.message", "event.messages", "event.message"]
