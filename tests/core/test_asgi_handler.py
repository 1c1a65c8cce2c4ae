"""The web process's Django handler answers as Django's own ASGI handler does, with one thread hop.

`apps.core.handlers.SyncChainASGIHandler` runs the synchronous middleware chain and view in one
sync_to_async call. Each request below goes to it and to Django's `ASGIHandler`, over real ASGI (the
`http` scope, the body in `http.request` messages), and both must answer the same status, headers that
matter and body; ours must never hop back to the event loop (`async_to_sync`) on the way to a view.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref import sync
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from django.core.handlers.asgi import ASGIHandler
from django.db import connections

from apps.core.handlers import RequestThreads, SyncChainASGIHandler
from tests.world import HOST_A, HOST_B, HOST_PROVIDER, World


@pytest.fixture(autouse=True)
def _close_thread_connections() -> Iterator[None]:
    """The handlers query from asgiref's worker threads; close their connections after each test."""
    yield
    asyncio.run(sync_to_async(connections.close_all)())


@pytest.fixture
def handler() -> Iterator[SyncChainASGIHandler]:
    """Ours, its kept request threads ended after the test (each closing its connections)."""
    ours = SyncChainASGIHandler()
    yield ours
    ours.threads.close()


async def ask(
    application: Any, method: str, path: str, host: str, token: str | None, body: bytes
) -> dict[str, Any]:
    path, _, query = path.partition("?")
    headers = [(b"host", host.encode()), (b"content-type", b"application/json")]
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    communicator = ApplicationCommunicator(application, scope)
    # A body in two messages, as a client streaming it would send it.
    half = len(body) // 2
    await communicator.send_input({"type": "http.request", "body": body[:half], "more_body": True})
    await communicator.send_input({"type": "http.request", "body": body[half:], "more_body": False})
    start = await communicator.receive_output(timeout=20)
    chunks = []
    while True:
        message = await communicator.receive_output(timeout=20)
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    await communicator.wait(timeout=5)
    headers_out = {name.decode().lower(): value.decode() for name, value in start["headers"]}
    return {"status": start["status"], "headers": headers_out, "body": b"".join(chunks)}


def comparable(answer: dict[str, Any]) -> tuple[int, str, Any]:
    body: Any = answer["body"]
    if answer["headers"].get("content-type", "").startswith("application/json"):
        body = json.loads(body)
        if isinstance(body, dict):
            body.pop("request_id", None)
    elif answer["headers"].get("content-type", "").startswith("text/html"):
        body = b"<form" in body  # a page's CSRF token differs each time: compare that it is a form page
    return answer["status"], answer["headers"].get("content-type", ""), body


REQUESTS = [
    ("GET", "/healthz", HOST_A, None, b"", 200),
    ("GET", "/api/v1/me/", HOST_A, "alice", b"", 200),
    ("GET", "/api/v1/me/", HOST_B, "charlie", b"", 200),
    ("GET", "/api/v1/me/", HOST_B, "alice", b"", 401),  # another tenant's token
    ("GET", "/api/v1/me/", "nowhere.klique.test", None, b"", 404),  # no tenant there
    ("GET", "/api/v1/no-such-route/", HOST_A, "alice", b"", 404),
    ("GET", "/api/v1/users/?limit=2", HOST_A, "alice", b"", 200),
    ("GET", "/api/v1/provider/tenants/", HOST_PROVIDER, "root", b"", 200),
    ("POST", "/api/v1/tokens/", HOST_A, "dave", b'{"name": "x"', 400),  # malformed JSON
    ("POST", "/api/v1/users/", HOST_A, "dave", b'{"username": "eve"}', 403),  # a viewer may not
    ("GET", "/api/v1/me/?q=%00", HOST_A, "alice", b"", 400),  # NUL refused at the edge
    ("GET", "/portal/sign-in/", HOST_A, None, b"", 200),  # a page: sessions, CSRF, the CSP header
    ("GET", "/portal/", HOST_A, None, b"", 302),  # signed out: to the sign-in page
]


@pytest.mark.parametrize(("method", "path", "host", "who", "body", "status"), REQUESTS)
def test_it_answers_as_django_s_handler_does(
    world: World,
    db: None,
    handler: SyncChainASGIHandler,
    method: str,
    path: str,
    host: str,
    who: str | None,
    body: bytes,
    status: int,
) -> None:
    token = world.tokens[who] if who else None

    async def both() -> tuple[dict[str, Any], dict[str, Any]]:
        ours = await ask(handler, method, path, host, token, body)
        django = await ask(ASGIHandler(), method, path, host, token, body)
        return ours, django

    ours, django = asyncio.run(both())
    assert ours["status"] == status, ours
    assert comparable(ours) == comparable(django)
    assert ours["headers"].get("x-request-id")
    for header in ("location", "content-security-policy", "x-frame-options", "www-authenticate"):
        assert ours["headers"].get(header) == django["headers"].get(header)


def test_a_view_is_reached_without_a_hop_back_to_the_event_loop(
    world: World, db: None, monkeypatch: pytest.MonkeyPatch, handler: SyncChainASGIHandler
) -> None:
    hops: list[str] = []
    original = sync.AsyncToSync.__call__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(self.awaitable, "__qualname__", "?"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(sync.AsyncToSync, "__call__", counted)

    async def once(application: Any) -> dict[str, Any]:
        return await ask(application, "GET", "/api/v1/me/", HOST_A, world.tokens["alice"], b"")

    assert asyncio.run(once(handler))["status"] == 200
    ours = list(hops)
    hops.clear()
    assert asyncio.run(once(ASGIHandler()))["status"] == 200
    assert not any("get_response" in hop for hop in ours), ours
    assert any("get_response" in hop for hop in hops), hops  # Django's own hops back, to reach the view


def test_a_request_thread_serves_the_next_request_and_holds_no_connection_between(
    world: World, db: None, handler: SyncChainASGIHandler
) -> None:
    """Requests one after another are served by one kept thread, not a new thread each; between them the
    thread holds no database connection (Django closes it at the request's end, as with a new thread)."""
    served: list[int] = []
    original = handler.get_response

    def recorded(request: Any) -> Any:
        served.append(threading.get_ident())
        return original(request)

    handler.get_response = recorded  # type: ignore[method-assign]

    async def three() -> list[int]:
        statuses = []
        for who in ("alice", "bob", "alice"):
            answer = await ask(handler, "GET", "/api/v1/me/", HOST_A, world.tokens[who], b"")
            statuses.append(answer["status"])
        return statuses

    assert asyncio.run(three()) == [200, 200, 200]
    assert len(set(served)) == 1
    assert len(handler.threads.idle) == 1
    kept = handler.threads.idle[0]
    # Closed by Django's request_finished in that thread (CONN_MAX_AGE 0 here, as in `klique web`, whose
    # pool takes the connection back): had the response been closed in another thread, it would be open.
    assert kept.submit(lambda: connections["default"].connection is None).result()


def test_a_thread_still_busy_after_its_request_is_not_kept() -> None:
    """A client that left while its view ran: the request is over, the view still runs in its thread."""
    threads = RequestThreads(keep=4)
    thread = threads.take()
    release = threading.Event()
    running = thread.submit(release.wait, 10)
    threads.give(thread, finished=True)
    assert threads.idle == []  # the next request must not queue behind the old view
    release.set()
    assert running.result(5) is True


def test_a_failed_request_s_thread_is_not_kept_and_at_most_keep_idle_threads_are() -> None:
    threads = RequestThreads(keep=2)
    failed = threads.take()
    threads.give(failed, finished=False)
    assert threads.idle == []
    taken = [threads.take() for _ in range(3)]
    assert len({id(thread) for thread in taken}) == 3
    for thread in taken:
        threads.give(thread, finished=True)
    assert threads.idle == taken[:2]
    assert threads.take() is taken[1]  # the most recently used first: its caches are warm
    threads.close()
