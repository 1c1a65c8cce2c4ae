"""A request to a host seen before is one prepared statement that names the remembered schema's tables.

`tenants.selectors` remembers the schema of the tenant last found at each host. The statement that uses
the guess checks it (the host's tenant must have that schema, or no row comes back at all), so these
tests (each starting with no host remembered, tests/tenants/conftest.py) make the guess wrong every way
it can be (the host moved to another tenant, the schema gone, another tenant's schema planted, the host
removed) and check that each answer is the one a lookup gives, that no row of another schema is read,
and that the guess is put right. They also check that the statement is prepared on the connection, and
that the memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django_tenants.utils import get_public_schema_name
from rest_framework.test import APIClient

from apps.accounts.services import token_read_sql
from tenants import selectors
from tenants.models import Domain, Tenant
from tests.world import HOST_A, HOST_B, HOST_PROVIDER, World


def prefix_of(world: World, persona: str) -> str:
    return world.tokens[persona].split("_")[1]


def me(world: World, host: str, persona: str) -> tuple[int, Any]:
    response = APIClient(HTTP_HOST=host, HTTP_AUTHORIZATION=f"Bearer {world.tokens[persona]}").get(
        "/api/v1/me/"
    )
    return response.status_code, response.json()


def statements(action: Callable[[], object]) -> list[str]:
    """The statements `action` sends that find a tenant by host (a first use of a token also records
    it, once a minute at most)."""
    with CaptureQueriesContext(connection) as queries:
        action()
    return [query["sql"] for query in queries.captured_queries if "tenants_domain" in query["sql"]]


def test_a_host_seen_before_is_one_prepared_statement(world: World, db: None) -> None:
    [lookup] = statements(lambda: me(world, HOST_A, "alice"))
    assert "current_schema()" in lookup  # not seen yet: looked up
    assert selectors._schema_at_host == {HOST_A: "acme"}
    with CaptureQueriesContext(connection) as queries:
        assert me(world, HOST_A, "alice") == (200, me(world, HOST_A, "alice")[1])
    # Nothing but the one statement, each time.
    [known, again] = [query["sql"] for query in queries.captured_queries if "SAVEPOINT" not in query["sql"]]
    assert known == again
    assert '"acme".accounts_apitoken' in known
    assert "LATERAL" in known
    assert "current_schema()" not in known
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements WHERE statement LIKE %s", ["%LATERAL%"])
        prepared = [row[0] for row in cursor.fetchall()]
    assert any('"acme".accounts_apitoken' in text for text in prepared)
    # Preparing is enabled for that cursor only: Django's own cursors still bind in the client.
    assert connection.connection.prepare_threshold is None


def test_the_answers_are_those_of_a_lookup_for_every_host_and_token(world: World, db: None) -> None:
    cases = [(host, persona) for host in (HOST_A, HOST_B) for persona in ("alice", "bob", "charlie", "root")]
    looked_up = {}
    for host, persona in cases:
        selectors._schema_at_host.clear()
        looked_up[host, persona] = me(world, host, persona)
    for host, persona in cases:
        me(world, host, persona)  # remembered now, if it was found
        assert me(world, host, persona) == looked_up[host, persona], (host, persona)
    assert looked_up[HOST_A, "alice"][1]["username"] == "alice"
    assert looked_up[HOST_B, "charlie"][1]["username"] == "charlie"
    assert looked_up[HOST_A, "charlie"][0] == looked_up[HOST_B, "alice"][0] == 401


def test_a_wrong_guess_reads_nothing_of_the_schema_it_names(world: World, db: None) -> None:
    charlie, alice = prefix_of(world, "charlie"), prefix_of(world, "alice")
    # The statement itself, guessing globex for acme's host, returns no row at all: not globex's token.
    sql, arguments = selectors.known_schema_statement(HOST_A, "globex", token_read_sql, [charlie])
    with connection.cursor() as cursor:
        cursor.execute(sql, arguments)
        assert cursor.fetchone() is None
    # A planted wrong guess is checked, forgotten and put right: acme's tenant, and charlie's token is
    # not found in acme, though the guess named globex where it lives.
    selectors._schema_at_host[HOST_A] = "globex"
    tenant, row = selectors.tenant_enter_reading(HOST_A, token_read_sql, [charlie])
    assert (tenant.schema_name if tenant else None, row) == ("acme", None)
    assert selectors._schema_at_host[HOST_A] == "acme"
    selectors._schema_at_host[HOST_A] = "globex"
    tenant, row = selectors.tenant_enter_reading(HOST_A, token_read_sql, [alice])
    assert row is not None
    assert alice in row
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_schema()")
        assert cursor.fetchone() == ("acme",)


@pytest.mark.parametrize("planted", ["nowhere", "acme; DROP TABLE x", 'ac"me', "public", "pg_catalog"])
def test_a_guess_of_a_schema_that_does_not_hold_the_tables_costs_a_lookup(
    world: World, db: None, planted: str
) -> None:
    alice = prefix_of(world, "alice")
    before = selectors._Texts.generation
    selectors._schema_at_host[HOST_A] = planted
    tenant, row = selectors.tenant_enter_reading(HOST_A, token_read_sql, [alice])
    assert tenant is not None
    assert tenant.schema_name == "acme"
    assert row is not None
    assert alice in row
    assert selectors._schema_at_host[HOST_A] == "acme"
    if planted != "public":  # (public's tables exist: its statement runs and finds no such host)
        assert selectors._Texts.generation == before + 1  # the failed texts are not used again
    # The test's transaction is still usable: the failure was kept to a savepoint.
    assert me(world, HOST_A, "alice")[0] == 200


def test_a_host_moved_to_another_tenant_serves_that_tenant_at_once(world: World, db: None) -> None:
    assert me(world, HOST_A, "alice")[0] == 200
    assert selectors._schema_at_host[HOST_A] == "acme"
    globex = Tenant.objects.get(schema_name="globex")
    Domain.objects.filter(domain=HOST_A).update(tenant=globex)
    assert me(world, HOST_A, "alice")[0] == 401  # acme's token is not globex's
    status, body = me(world, HOST_A, "charlie")
    assert (status, body["username"]) == (200, "charlie")
    assert selectors._schema_at_host[HOST_A] == "globex"


def test_a_host_removed_is_forgotten_and_answers_404(world: World, db: None) -> None:
    assert me(world, HOST_A, "alice")[0] == 200
    Domain.objects.filter(domain=HOST_A).delete()
    status, body = me(world, HOST_A, "alice")
    assert status == 404
    assert "No tenant is served" in body["detail"]
    assert HOST_A not in selectors._schema_at_host


def test_a_suspension_holds_on_the_next_request(world: World, db: None) -> None:
    assert me(world, HOST_A, "alice")[0] == 200
    Tenant.objects.filter(schema_name="acme").update(status="suspended", suspended_reason="Unpaid.")
    status, body = me(world, HOST_A, "alice")
    assert status == 403
    assert "suspended" in body["detail"]


def test_no_read_and_unknown_and_provider_hosts(world: World, db: None) -> None:
    # Without a bearer token the known statement reads the tenant only.
    me(world, HOST_A, "alice")
    [known] = statements(lambda: APIClient(HTTP_HOST=HOST_A).get("/api/v1/me/"))
    assert "accounts_apitoken" not in known
    assert '"acme"' in known
    # An unknown host and the provider's are never remembered.
    assert selectors.tenant_enter_reading("nowhere.klique.test") == (None, None)
    assert selectors.tenant_enter_reading(HOST_PROVIDER)[0].schema_name == get_public_schema_name()  # type: ignore[union-attr]
    assert set(selectors._schema_at_host) == {HOST_A}


def test_hosts_are_remembered_up_to_a_bound(world: World, db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selectors, "HOSTS_REMEMBERED", 1)
    selectors.tenant_enter_reading(HOST_A)
    selectors.tenant_enter_reading(HOST_B)
    assert selectors._schema_at_host == {HOST_B: "globex"}


def test_without_an_enter_read_the_known_statement_reads_the_tenant_only(world: World, db: None) -> None:
    with override_settings(TENANT_ENTER_READ=None):
        assert me(world, HOST_A, "alice")[0] == 200
        [known, *_] = statements(lambda: me(world, HOST_A, "alice"))
    assert "accounts_apitoken" not in known


def test_a_table_changed_under_a_prepared_statement_costs_one_lookup(world: World, db: None) -> None:
    # PostgreSQL refuses to run a prepared statement whose result's columns changed type ("cached plan
    # must not change result type") for as long as it is kept: the texts change, so it is not run again.
    for _ in range(2):
        assert me(world, HOST_A, "alice")[0] == 200  # looked up, then prepared
    before = selectors._Texts.generation
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE public.tenants_tenant ALTER COLUMN name TYPE varchar(201)")
    assert me(world, HOST_A, "alice")[0] == 200
    assert selectors._Texts.generation == before + 1
    [known] = statements(lambda: me(world, HOST_A, "alice"))
    assert f"/* {before + 1} */" in known
    assert selectors._Texts.generation == before + 1  # the new text runs
