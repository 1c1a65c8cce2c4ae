"""Who the internal route lets through: a person signed in to the portal (one-time ticket, then the app
host's cookie) or holding a token, the app shared with them; anyone and anything else is refused, and
Klique's own credentials never reach the app."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest
from django.contrib.sessions.backends.db import SessionStore
from django.test import Client
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.catalogue import addresses, admissions, route, tickets
from apps.catalogue.admissions import Admission, Admissions
from apps.catalogue.models import AppInstance
from apps.scheduling.models import Task, TaskState
from tests.catalogue.conftest import launch
from tests.world import HOST_A, HOST_B, World

pytestmark = pytest.mark.django_db


def ready(app: AppInstance) -> AppInstance:
    """As if its agent ran it and opened its tunnel."""
    Task.objects.filter(pk=str(app.task_id)).update(state=TaskState.RUNNING)
    AppInstance.objects.filter(pk=app.pk).update(tunnel_channel="tunnel-1", ready_at=timezone.now())
    return AppInstance.objects.select_related("task").get(pk=app.pk)


def session_of(persona: str) -> str:
    session = SessionStore()
    session["_auth_user_id"] = str(User.objects.get(username=persona).pk)
    session.create()
    return str(session.session_key)


def scope(app: AppInstance, path: str = "/", *, host: str = HOST_A, **extra: Any) -> dict[str, Any]:
    headers = [(b"host", addresses.app_host(app.slug, host).encode())]
    headers += [(name.encode(), value.encode()) for name, value in extra.pop("headers", {}).items()]
    return {"type": "http", "scheme": "http", "method": "GET", "path": path, "headers": headers, **extra}


def enter(app: AppInstance, ticket: str, next_path: str = "/lab") -> Admission:
    query = urlencode({"ticket": ticket, "next": next_path}).encode()
    return route._admit(scope(app, route.ENTER_PATH, query_string=query))


@pytest.fixture
def app(world: World) -> AppInstance:
    made = launch(world, name="notebook", project="apollo", share_with_project=True)
    with schema_context(world.tenant_a.schema_name):
        return ready(made)


def test_a_ticket_is_good_once_then_the_cookie_lets_the_person_in(app: AppInstance, world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        key = session_of("carol")
    ticket = tickets.ticket(session_key=key, app_id=str(app.pk))
    entered = enter(app, ticket)
    assert (entered.status, entered.location) == (303, "/lab")
    assert enter(app, ticket).status == 403  # used
    cookie = f"{tickets.COOKIE}={entered.set_cookie}; _xsrf=abc"
    admitted = route._admit(scope(app, headers={"cookie": cookie}))
    assert (admitted.status, admitted.channel, admitted.app_id) == (0, "tunnel-1", str(app.pk))
    with schema_context(world.tenant_a.schema_name):
        SessionStore(session_key=key).delete()  # signed out of the portal: out of the app too
    assert route._admit(scope(app, headers={"cookie": cookie})).status == 401


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "\\\\evil", "lab"])
def test_a_ticket_never_sends_anyone_off_the_apps_host(app: AppInstance, world: World, target: str) -> None:
    with schema_context(world.tenant_a.schema_name):
        key = session_of("bob")
    entered = enter(app, tickets.ticket(session_key=key, app_id=str(app.pk)), target)
    assert (entered.status, entered.location) == (303, "/")


def test_a_ticket_or_cookie_of_another_app_or_forged_is_refused(app: AppInstance, world: World) -> None:
    other = launch(world, name="other")
    with schema_context(world.tenant_a.schema_name):
        key = session_of("bob")
        ready(other)
    assert enter(app, tickets.ticket(session_key=key, app_id=str(other.pk))).status == 403
    assert enter(app, "forged:ticket").status == 403
    their_cookie = tickets.cookie(session_key=key, app_id=str(other.pk))
    assert route._admit(scope(app, headers={"cookie": f"{tickets.COOKIE}={their_cookie}"})).status == 401
    assert route._admit(scope(app, headers={"cookie": f"{tickets.COOKIE}=x:y:z"})).status == 401


def test_people_the_app_is_not_shared_with_get_404(app: AppInstance, world: World) -> None:
    for persona, status in (("bob", 0), ("carol", 0), ("dave", 404)):
        token = f"Bearer {world.tokens[persona]}"
        assert route._admit(scope(app, headers={"authorization": token})).status == status, persona
    charlie = f"Bearer {world.tokens['charlie']}"  # another tenant's admin, at his own tenant's host
    assert route._admit(scope(app, host=HOST_B, headers={"authorization": charlie})).status == 404
    assert route._admit(scope(app, headers={"authorization": charlie})).status == 401
    anonymous = route._admit(scope(app))
    assert anonymous.status == 401
    assert f"http://{HOST_A}/apps/{app.pk}/" in anonymous.detail


@pytest.mark.parametrize(
    "host", ["app-0000000000000000.acme.klique.test", "app-short.acme.klique.test", "app-x.nowhere.test"]
)
def test_no_app_at_an_unknown_host(host: str) -> None:
    assert route._admit({"type": "http", "path": "/", "headers": [(b"host", host.encode())]}).status == 404


def test_a_stopped_or_unconnected_app_says_so(app: AppInstance, world: World) -> None:
    token = {"authorization": f"Bearer {world.tokens['bob']}"}
    with schema_context(world.tenant_a.schema_name):
        AppInstance.objects.filter(pk=app.pk).update(tunnel_channel="")
    waiting = route._admit(scope(app, headers=token))
    assert waiting.status == 503
    assert "reconnecting" in waiting.detail
    with schema_context(world.tenant_a.schema_name):
        Task.objects.filter(pk=str(app.task_id)).update(state=TaskState.COMPLETED)
    assert route._admit(scope(app, headers=token)).status == 409


def test_klique_credentials_and_connection_headers_never_reach_the_app() -> None:
    passed = route._passed_headers(
        {
            "type": "http",
            "scheme": "https",
            "client": ("10.0.0.9", 5000),
            "headers": [
                (b"host", b"app-x.acme.klique.test"),
                (b"authorization", b"Bearer klq_abcdefgh_" + b"0" * 32),
                (b"cookie", f"a=1; {tickets.COOKIE}=secret; b=2".encode()),
                (b"connection", b"keep-alive"),
                (b"transfer-encoding", b"chunked"),
                (b"origin", b"https://app-x.acme.klique.test"),
                (b"x-keep", b"yes"),
            ],
        }
    )
    assert passed == [
        ["cookie", "a=1; b=2"],
        ["x-keep", "yes"],
        ["x-forwarded-host", "app-x.acme.klique.test"],
        ["x-forwarded-proto", "https"],
        ["x-forwarded-for", "10.0.0.9"],
    ]
    own_token = route._passed_headers({"headers": [(b"authorization", b"Bearer sk-model-key")]})
    assert own_token[0] == ["authorization", "Bearer sk-model-key"]  # the app's own key is the app's


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        ("", True),
        ("http://app-x.acme.klique.test", True),
        ("HTTP://APP-X.ACME.KLIQUE.TEST", True),
        ("http://acme.klique.test", False),
        ("http://app-y.acme.klique.test", False),
        ("https://app-x.acme.klique.test", False),
        ("null", False),
    ],
)
def test_requests_that_change_things_come_from_the_apps_own_pages(origin: str, allowed: bool) -> None:
    headers = [(b"host", b"app-x.acme.klique.test")] + ([(b"origin", origin.encode())] if origin else [])
    assert route._same_origin({"scheme": "http", "headers": headers}) is allowed
    assert route._same_origin({"scheme": "ws", "headers": headers}) is allowed


def test_the_stable_address_sends_a_signed_in_person_on_with_a_ticket(app: AppInstance, world: World) -> None:
    client = Client(HTTP_HOST=HOST_A)
    assert (
        client.get(f"/apps/{app.pk}/lab").headers["location"] == f"/portal/sign-in/?next=/apps/{app.pk}/lab"
    )
    with schema_context(world.tenant_a.schema_name):
        client.force_login(User.objects.get(username="carol"))
    sent = client.get(f"/apps/{app.pk}/lab")
    assert sent.status_code == 302
    target = urlsplit(sent.headers["location"])
    assert target.netloc == addresses.app_host(app.slug, HOST_A)
    assert target.path == route.ENTER_PATH
    assert parse_qs(target.query)["next"] == ["/lab"]
    with schema_context(world.tenant_a.schema_name):
        client.force_login(User.objects.get(username="dave"))
    assert client.get(f"/apps/{app.pk}/").status_code == 404


def test_a_stopped_apps_address_offers_to_start_it(app: AppInstance, world: World) -> None:
    client = Client(HTTP_HOST=HOST_A)
    with schema_context(world.tenant_a.schema_name):
        Task.objects.filter(pk=str(app.task_id)).update(state=TaskState.FAILED, reason="It exited.")
        client.force_login(User.objects.get(username="bob"))
    page = client.get(f"/apps/{app.pk}/")
    assert page.status_code == 409
    assert b"notebook is stopped" in page.content
    assert b"Start notebook again" in page.content
    started = client.post(f"/apps/{app.pk}/")
    assert started.status_code == 302
    with schema_context(world.tenant_a.schema_name):
        assert AppInstance.objects.get(pk=app.pk).task_id != app.task_id


def test_only_admissions_are_kept_for_a_moment_and_a_closed_tunnel_forgets_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = Admissions()
    key = ("app-x.acme.klique.test", "Bearer klq_x", "http")
    kept.keep(key, Admission(404, "No app is served at this address."))
    assert kept.get(key) is None  # refusals are never kept: the next request asks the database
    kept.keep(key, Admission(0, channel="tunnel-1"))
    kept.keep(None, Admission(0, channel="tunnel-1"))
    assert kept.get(key) == Admission(0, channel="tunnel-1")
    assert kept.get(None) is None
    kept.forget("tunnel-2")
    assert kept.get(key) is not None
    kept.forget("tunnel-1")
    assert kept.get(key) is None
    kept.keep(key, Admission(0, channel="tunnel-1"))
    later = time.monotonic() + admissions.ADMITTED_SECONDS + 0.1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert kept.get(key) is None  # a revoked token or a withdrawn share counts within seconds


@pytest.mark.parametrize(
    ("path", "headers", "kept"),
    [
        ("/", [(b"authorization", b"Bearer klq_x")], True),
        ("/", [(b"cookie", f"{tickets.COOKIE}=abc".encode())], True),
        ("/", [(b"cookie", b"other=1")], False),
        (route.ENTER_PATH, [(b"authorization", b"Bearer klq_x")], False),
    ],
)
def test_an_admission_is_kept_under_its_credential_only(path: str, headers: list[Any], kept: bool) -> None:
    scope = {"type": "http", "scheme": "http", "path": path, "headers": [(b"host", b"app-x.h"), *headers]}
    assert (route.admissions_key(scope) is not None) is kept
