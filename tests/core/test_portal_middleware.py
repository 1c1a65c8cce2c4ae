"""A bearer-token API call passes the portal's middlewares (apps.core.portal_middleware) and is answered
exactly as with Django's own: each request below is sent through Klique's chain and through the same
chain with Django's session, CSRF, auth and message middlewares in their place, and both answers must
agree in status, every header, every cookie and the body. Sessions and CSRF still hold where they serve:
the portal's pages, and the API called by session."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.contrib.sessions.middleware import SessionMiddleware
from django.http import HttpRequest
from django.test import Client, RequestFactory, override_settings
from django.urls import URLResolver, get_resolver
from django_tenants.utils import schema_context
from rest_framework.views import APIView

from apps.core.portal_middleware import bearer_api_call
from tests.world import HOST_A, HOST_B, World

OURS = "apps.core.portal_middleware"
DJANGO_S = {
    f"{OURS}.PortalSessionMiddleware": "django.contrib.sessions.middleware.SessionMiddleware",
    f"{OURS}.PortalCsrfMiddleware": "django.middleware.csrf.CsrfViewMiddleware",
    f"{OURS}.PortalAuthenticationMiddleware": "django.contrib.auth.middleware.AuthenticationMiddleware",
    f"{OURS}.PortalMessageMiddleware": "django.contrib.messages.middleware.MessageMiddleware",
}
VOLATILE = {"x-request-id"}  # one per request


def test_klique_s_chain_names_the_portal_middlewares_in_django_s_places() -> None:
    django_s = [DJANGO_S.get(name, name) for name in settings.MIDDLEWARE]
    assert django_s != settings.MIDDLEWARE
    assert set(DJANGO_S.values()) <= set(django_s)


@pytest.fixture
def bob_s_session(world: World, db: None) -> Iterator[str]:
    """The session cookie of bob, signed in to the portal of tenant A."""
    from apps.accounts.models import User

    with schema_context("acme"):
        client = Client()
        client.force_login(User.objects.get(username="bob"))
        yield client.cookies[settings.SESSION_COOKIE_NAME].value


def answer(
    method: str, path: str, host: str, authorization: str | None, body: bytes, cookies: dict[str, str]
) -> dict[str, Any]:
    client = Client(enforce_csrf_checks=True)
    for name, value in cookies.items():
        client.cookies[name] = value
    extra: dict[str, Any] = {"HTTP_HOST": host}
    if authorization is not None:
        extra["HTTP_AUTHORIZATION"] = authorization
    response = client.generic(method, path, body, content_type="application/json", **extra)
    content: Any = response.content
    if response.get("Content-Type", "").startswith("application/json"):
        content = json.loads(content)
        for volatile in ("request_id", "id", "prefix", "token", "created_at", "expires_at"):
            if isinstance(content, dict):
                content.pop(volatile, None)
    headers = {name.lower(): value for name, value in response.headers.items()}
    for volatile in VOLATILE:
        headers.pop(volatile, None)
    return {
        "status": response.status_code,
        "headers": headers,
        "cookies": {name: morsel.OutputString() for name, morsel in response.cookies.items()},
        "body": content,
    }


CALLS = [
    # (method, path, host, who or a raw Authorization, body, with bob's session and CSRF cookies, status)
    ("GET", "/api/v1/me/", HOST_A, "alice", b"", False, 200),
    ("GET", "/api/v1/me/", HOST_A, "alice", b"", True, 200),  # the token wins over the session
    ("GET", "/api/v1/me/", HOST_A, "bearer:alice", b"", False, 200),  # the scheme in lower case
    ("GET", "/api/v1/me/", HOST_B, "alice", b"", True, 401),  # another tenant's token
    ("GET", "/api/v1/me/", HOST_A, "Bearer klq_nothing", b"", True, 401),  # malformed
    ("GET", "/api/v1/me/", HOST_A, "Bearer ", b"", True, 401),  # empty
    ("GET", "/api/v1/me/", HOST_A, "Bearer klq_abcdefgh_" + "x" * 32, b"", False, 401),  # no such token
    ("GET", "/api/v1/me", HOST_A, "alice", b"", False, 301),  # the slash Django appends
    ("GET", "/api/v1/no-such-route/", HOST_A, "alice", b"", True, 404),
    ("GET", "/api/v1/me/?q=%00", HOST_A, "alice", b"", False, 400),  # NUL refused at the edge
    ("POST", "/api/v1/users/", HOST_A, "dave", b'{"username": "eve"}', True, 403),  # a viewer may not
    ("POST", "/api/v1/tokens/", HOST_A, "alice", b'{"name": "x"', True, 400),  # malformed JSON
    ("POST", "/api/v1/tokens/", HOST_A, "alice", b'{"name": "from a script"}', True, 201),  # no CSRF asked
    ("DELETE", "/api/v1/tokens/00000000-0000-0000-0000-000000000000/", HOST_A, "alice", b"", True, 404),
    # Not bearer calls: Django's middlewares run for them either way.
    ("GET", "/api/v1/me/", HOST_A, None, b"", True, 200),  # the portal's own call, by session
    ("POST", "/api/v1/tokens/", HOST_A, None, b'{"name": "x"}', True, 403),  # by session without CSRF
    ("GET", "/api/v1/me/", HOST_A, "Basic Ym9iOnNlY3JldA==", b"", True, 200),  # another scheme: the session
    ("GET", "/portal/", HOST_A, "alice", b"", True, 200),  # a page, bearer header or not: bob's session
    ("GET", "/portal/sign-in/", HOST_A, "alice", b"", False, 200),
]


@pytest.mark.parametrize(("method", "path", "host", "who", "body", "session", "status"), CALLS)
def test_a_call_is_answered_as_through_django_s_middlewares(
    world: World,
    bob_s_session: str,
    method: str,
    path: str,
    host: str,
    who: str | None,
    body: bytes,
    session: bool,
    status: int,
) -> None:
    if who is None or " " in who:
        authorization = who
    elif who.startswith("bearer:"):
        authorization = f"bearer {world.tokens[who.removeprefix('bearer:')]}"
    else:
        authorization = f"Bearer {world.tokens[who]}"
    cookies = {settings.SESSION_COOKIE_NAME: bob_s_session, settings.CSRF_COOKIE_NAME: "c" * 32}
    if not session:
        cookies = {}

    ours = answer(method, path, host, authorization, body, cookies)
    with override_settings(MIDDLEWARE=[DJANGO_S.get(name, name) for name in settings.MIDDLEWARE]):
        django = answer(method, path, host, authorization, body, cookies)

    assert ours["status"] == status, ours
    if path.startswith("/portal/"):  # a page's CSRF token differs each time: compare all but the form
        ours["body"] = django["body"] = None
        ours["cookies"].pop(settings.CSRF_COOKIE_NAME, None)
        django["cookies"].pop(settings.CSRF_COOKIE_NAME, None)
    assert ours == django


@pytest.mark.parametrize(
    ("path", "authorization", "passed"),
    [
        ("/api/v1/me/", "Bearer klq_x", True),
        ("/api/v1/tasks/", "BEARER klq_x", True),
        ("/api/v1/me/", "Bearer ", True),  # refused by DRF, never by a session
        ("/api/v1/me/", "Bearerklq_x", False),
        ("/api/v1/me/", "Basic eDp5", False),
        ("/api/v1/me/", None, False),
        ("/api/schema/", "Bearer klq_x", False),  # not under /api/v1/
        ("/portal/", "Bearer klq_x", False),
        ("/agents/v1/tasks/", "Bearer klq_x", False),
        ("/apiv1/me/", "Bearer klq_x", False),
    ],
)
def test_only_a_bearer_call_under_the_api_passes_them(
    path: str, authorization: str | None, passed: bool
) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    assert bearer_api_call(RequestFactory().get(path, headers=headers)) is passed


def _routes(patterns: list[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _routes(pattern.url_patterns, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern.callback


@pytest.mark.parametrize("urlconf", [settings.ROOT_URLCONF, settings.PUBLIC_SCHEMA_URLCONF])
def test_every_view_under_the_api_is_drf_s(urlconf: str) -> None:
    """What passing the portal's middlewares rests on: DRF authenticates each call under /api/v1/ (so a
    bearer call never falls back to a session) and exempts it from CSRF."""
    api = [
        (route, view)
        for route, view in _routes(get_resolver(urlconf).url_patterns)
        if route.startswith("api/v1/")
    ]
    assert len(api) >= 10
    for route, view in api:
        assert issubclass(getattr(view, "cls", type(None)), APIView), route
        assert getattr(view, "csrf_exempt", False), route


def test_a_bearer_call_makes_no_session_and_a_page_does(
    world: World, bob_s_session: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    original = SessionMiddleware.process_request

    def counted(self: SessionMiddleware, request: HttpRequest) -> None:
        made.append(request.path)
        original(self, request)

    monkeypatch.setattr(SessionMiddleware, "process_request", counted)
    cookies = {settings.SESSION_COOKIE_NAME: bob_s_session}
    alice = f"Bearer {world.tokens['alice']}"
    assert answer("GET", "/api/v1/me/", HOST_A, alice, b"", cookies)["body"]["username"] == "alice"
    assert made == []
    assert answer("GET", "/api/v1/me/", HOST_A, None, b"", cookies)["body"]["username"] == "bob"
    assert answer("GET", "/portal/", HOST_A, alice, b"", cookies)["status"] == 200
    assert made == ["/api/v1/me/", "/portal/"]
