"""The portal's websockets: a signed-in session opens them from its own tenant's pages only."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.sessions.backends.db import SessionStore
from django.db import connections
from django_tenants.utils import schema_context

from apps.accounts.models import User
from config.asgi import application
from tests.gateway.conftest import committed
from tests.world import HOST_A, World

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _close_consumer_connections() -> Iterator[None]:
    yield
    asyncio.run(sync_to_async(connections.close_all)())


@pytest.fixture
def bobs_session(world: World, django_db_blocker: Any) -> Iterator[str]:
    def make() -> str:
        with schema_context("acme"):
            store = SessionStore()
            store["_auth_user_id"] = str(User.objects.get(username="bob").pk)
            store.create()
            return str(store.session_key)

    key = committed(django_db_blocker, make)
    yield key

    def drop() -> None:
        with schema_context("acme"):
            SessionStore(session_key=key).delete()

    committed(django_db_blocker, drop)


async def opened(origin: str, cookie: str) -> tuple[Any, Any]:
    headers = [(b"host", HOST_A.encode()), (b"origin", origin.encode()), (b"cookie", cookie.encode())]
    socket = WebsocketCommunicator(application, "/ws/v1/events/", headers=headers)
    await socket.connect()
    first = await socket.receive_json_from(timeout=10)
    closed = await socket.receive_output(timeout=10) if first.get("type") == "error" else None
    await socket.disconnect()
    return first, closed


def test_a_session_opens_the_events_socket_from_its_own_pages(bobs_session: str) -> None:
    first, _ = asyncio.run(opened(f"http://{HOST_A}", f"sessionid={bobs_session}"))
    assert first == {"type": "welcome", "tenant": "acme", "user": "bob"}


def test_another_sites_page_cannot_use_the_visitors_session(bobs_session: str) -> None:
    first, closed = asyncio.run(opened("https://evil.example", f"sessionid={bobs_session}"))
    assert first["detail"] == "A signed-in session opens websockets from its own tenant's pages only."
    assert closed == {"type": "websocket.close", "code": 4403}


def test_an_ended_session_is_told_to_sign_in_again(world: World) -> None:
    first, closed = asyncio.run(opened(f"http://{HOST_A}", "sessionid=nosuchsession"))
    assert first["detail"] == "The session has ended; sign in again."
    assert closed == {"type": "websocket.close", "code": 4401}


@pytest.mark.parametrize(
    "origin",
    [
        f"http://{HOST_A}:9999",  # another service on another port of the same host
        f"http://{HOST_A}:80.evil.example",
        f"http://{HOST_A}.evil.example",
        f"http://evil.{HOST_A}",
        "null",
        f"http://user@{HOST_A}:81",
    ],
)
def test_an_origin_of_another_port_or_host_is_refused(bobs_session: str, origin: str) -> None:
    first, closed = asyncio.run(opened(origin, f"sessionid={bobs_session}"))
    assert first["detail"] == "A signed-in session opens websockets from its own tenant's pages only."
    assert closed == {"type": "websocket.close", "code": 4403}


def test_the_default_port_of_the_pages_scheme_is_the_same_origin(bobs_session: str) -> None:
    for origin in (f"http://{HOST_A}:80", f"https://{HOST_A}"):  # the Host names no port
        first, _ = asyncio.run(opened(origin, f"sessionid={bobs_session}"))
        assert first["type"] == "welcome", (origin, first)
