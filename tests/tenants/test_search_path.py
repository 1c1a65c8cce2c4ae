"""Each request reads its own tenant's schema, though the search path is set only when it changes.

`tenants.selectors.tenant_enter` sets the connection's search path in the same statement that reads the
tenant, and django-tenants (TENANT_LIMIT_SET_CALLS) skips its own `SET` while the path it recorded
stands. The invariant checked after every request: where a path is recorded, it is the session's real
one; where none is, the next query sets it. A wrong record would run one tenant's request in another's
schema.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from apps.accounts.models import User
from tenants import selectors
from tests.world import World


def real_path() -> list[str]:
    with connection.connection.cursor() as raw:  # beneath django-tenants: no SET of its own
        raw.execute("SELECT current_setting('search_path')")
        (value,) = raw.fetchone()
    return [part.strip().strip('"') for part in value.split(",")]


def assert_recorded_path_is_real() -> None:
    recorded = connection.search_path_set_schemas  # type: ignore[attr-defined]
    if recorded is not None:
        assert real_path() == list(recorded)


# (who asks, at which address, what the answer must be)
CALLS: list[tuple[str, str, int, str | None]] = [
    ("alice", "a", 200, "alice"),
    ("charlie", "b", 200, "charlie"),
    ("root", "provider", 200, None),
    ("alice", "b", 401, None),  # alice's token at globex's address: belongs to another tenant
    ("charlie", "a", 401, None),
    ("nobody", "nowhere", 404, None),
    ("anonymous", "a", 401, None),
]


def call(api: Callable[..., APIClient], who: str, where: str) -> tuple[int, Any]:
    if where == "nowhere":
        response = APIClient(HTTP_HOST="nowhere.klique.test").get("/api/v1/me/")
    elif who == "anonymous":
        response = api(host=where).get("/api/v1/me/")
    elif where == "provider":
        response = api(who).get("/api/v1/provider/tenants/")
    else:
        response = api(who, host=where).get("/api/v1/me/")
    return response.status_code, response.json()


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_interleaved_tenants_each_read_their_own_schema(
    api: Callable[..., APIClient], world: World, seed: int
) -> None:
    sequence = random.Random(seed).choices(CALLS, k=40)
    for who, where, status, username in sequence:
        got, body = call(api, who, where)
        assert got == status, (who, where, body)
        if username is not None:
            assert body["username"] == username
        if where == "provider":
            listed = body if isinstance(body, list) else body["results"]
            assert {tenant["slug"] for tenant in listed} >= {"acme", "globex"}
        assert_recorded_path_is_real()


def test_a_request_enters_its_tenant_in_one_statement(api: Callable[..., APIClient], world: World) -> None:
    api("charlie", host="b").get("/api/v1/me/")  # the connection's path is globex's
    with CaptureQueriesContext(connection) as queries:
        assert api("alice").get("/api/v1/me/").json()["username"] == "alice"
    statements = [query["sql"] for query in queries.captured_queries]
    assert not any(sql.startswith("SET search_path") for sql in statements), statements
    assert "set_config('search_path'" in statements[0]
    assert real_path() == ["acme", "public"]


def test_an_unknown_host_leaves_no_path_recorded(api: Callable[..., APIClient], world: World) -> None:
    api("alice").get("/api/v1/me/")
    assert APIClient(HTTP_HOST="nowhere.klique.test").get("/api/v1/me/").status_code == 404
    assert connection.search_path_set_schemas is None  # type: ignore[attr-defined]
    # Still acme's path on the session, but the next query in public sets public's first.
    assert connection.schema_name == "public"  # type: ignore[attr-defined]
    assert not User.objects.filter(username="alice").exists()  # public has no tenant users
    assert real_path() == ["public"]


def test_a_failed_lookup_forgets_the_path(
    api: Callable[..., APIClient], world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    api("alice").get("/api/v1/me/")  # acme's path on the session

    def broken(*, entering: bool) -> str:
        return "SELECT no_such_function(%s, %s, %s, %s)"

    monkeypatch.setattr(selectors, "_by_host_sql", broken)
    forgotten = []

    def enter() -> None:
        try:
            selectors.tenant_enter("globex.klique.test")
        finally:
            forgotten.append(connection.search_path_set_schemas is None)  # type: ignore[attr-defined]

    with pytest.raises(Exception, match="no_such_function"), transaction.atomic():
        enter()
    assert forgotten == [True]
    # The rollback to the savepoint ran with no path recorded, so it set public's first.
    assert connection.schema_name == "public"  # type: ignore[attr-defined]
    assert_recorded_path_is_real()
    monkeypatch.undo()
    assert api("charlie", host="b").get("/api/v1/me/").json()["username"] == "charlie"
    assert_recorded_path_is_real()


def test_a_rolled_back_request_does_not_leave_a_stale_path(
    api: Callable[..., APIClient], world: World
) -> None:
    # Inside a transaction (as under pytest), the lookup's set_config is undone by a rollback to a
    # savepoint; django-tenants forgets what it recorded, and sets it again before its next statement.
    api("alice").get("/api/v1/me/")

    def failing_request() -> None:
        selectors.tenant_enter("globex.klique.test")
        assert real_path() == ["globex", "public"]
        raise RuntimeError("the request failed")

    with pytest.raises(RuntimeError), transaction.atomic():
        failing_request()
    assert_recorded_path_is_real()
    assert User.objects.filter(username="charlie").exists()  # read in globex's schema
    assert not User.objects.filter(username="alice").exists()
    assert api("alice").get("/api/v1/me/").json()["username"] == "alice"
    assert_recorded_path_is_real()


@pytest.mark.parametrize("host", ["ACME.klique.test", "Acme.Klique.Test"])
def test_hosts_are_matched_without_case(api: Callable[..., APIClient], world: World, host: str) -> None:
    client = APIClient(HTTP_HOST=host)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {world.tokens['alice']}")
    assert client.get("/api/v1/me/").json()["username"] == "alice"
    assert_recorded_path_is_real()
