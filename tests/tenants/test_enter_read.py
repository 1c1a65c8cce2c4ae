"""The bearer token's row is read in the round trip that finds the request's tenant.

`tenants.middleware` sends the tenant's lookup and the token's read (`apps.accounts.authentication.
BearerRead`) as one message: PostgreSQL resolves the second statement's names under the search path the
first has just set. What is decided of the row is unchanged (token_authenticate); these tests check that
every kind of presented token is answered as it was when the row had a round trip of its own, that the
read can never see another tenant's schema, and that an authenticated `GET /api/v1/me/` is one statement.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import ApiToken, User
from apps.accounts.services import token_read_sql
from tenants import selectors
from tests.world import HOST_A, HOST_B, HOST_PROVIDER, World


def prefix_of(token: str) -> str:
    return token.split("_")[1]


def presented(world: World) -> dict[str, str]:
    """Authorization headers of every kind a request may carry, by name."""
    alice, bob, charlie, root = (world.tokens[name] for name in ("alice", "bob", "charlie", "root"))
    return {
        "own": f"Bearer {alice}",
        "scheme in capitals": f"BEARER {alice}",
        "padded": f"Bearer   {alice}  ",
        "another tenant's": f"Bearer {charlie}",
        "the provider's": f"Bearer {root}",
        "forged secret, real prefix": f"Bearer klq_{prefix_of(alice)}_{'A' * 32}",
        "unknown prefix": f"Bearer klq_aaaaaaaa_{'B' * 32}",
        "malformed": "Bearer klq_short",
        "quote in the prefix": f"Bearer klq_aaaa'aaa_{'C' * 32}",
        "empty bearer": "Bearer ",
        "basic scheme": "Basic YWxpY2U6cGFzc3dvcmQ=",
        "revoked": f"Bearer {bob}",  # revoked below
        "expired": f"Bearer {world.tokens['dave']}",  # expired below
    }


def answer(host: str, authorization: str, path: str = "/api/v1/me/") -> tuple[int, Any]:
    response = APIClient(HTTP_HOST=host, HTTP_AUTHORIZATION=authorization).get(path)
    return response.status_code, response.json()


@pytest.fixture
def spoiled(world: World, db: None) -> None:
    """bob's token revoked, dave's expired."""
    with schema_context("acme"):
        ApiToken.objects.filter(pk=world.token_ids["bob"]).update(revoked_at=timezone.now())
        yesterday = timezone.now() - timedelta(days=1)
        ApiToken.objects.filter(pk=world.token_ids["dave"]).update(expires_at=yesterday)


@pytest.mark.parametrize("host", [HOST_A, HOST_B, HOST_PROVIDER, "nowhere.klique.test"])
def test_every_kind_of_token_is_answered_as_with_a_read_of_its_own(
    world: World, spoiled: None, host: str
) -> None:
    path = "/api/v1/provider/tenants/" if host == HOST_PROVIDER else "/api/v1/me/"
    kinds = presented(world)
    together = {kind: answer(host, header, path) for kind, header in kinds.items()}
    with override_settings(TENANT_ENTER_READ=None):
        apart = {kind: answer(host, header, path) for kind, header in kinds.items()}
    assert together == apart
    if host == HOST_A:  # the answers themselves, where each kind means something
        assert together["own"][1]["username"] == "alice"
        assert together["scheme in capitals"][0] == together["padded"][0] == 200
        assert "another tenant" in together["another tenant's"][1]["detail"]
        assert "was revoked" in together["revoked"][1]["detail"]
        assert "expired" in together["expired"][1]["detail"]
        for kind in ("the provider's", "forged secret, real prefix", "unknown prefix", "quote in the prefix"):
            assert together[kind][0] == 401, kind


def test_a_deactivated_user_and_a_revocation_count_on_the_very_next_request(world: World, db: None) -> None:
    token = f"Bearer {world.tokens['bob']}"
    assert answer(HOST_A, token)[0] == 200
    with schema_context("acme"):
        User.objects.filter(username="bob").update(is_active=False)
    status, body = answer(HOST_A, token)
    assert (status, "deactivated" in body["detail"]) == (401, True)
    with schema_context("acme"):
        User.objects.filter(username="bob").update(is_active=True)
    assert answer(HOST_A, token)[0] == 200
    with schema_context("acme"):
        ApiToken.objects.filter(pk=world.token_ids["bob"]).update(revoked_at=timezone.now())
    assert answer(HOST_A, token)[0] == 401


def test_the_read_sees_only_the_schema_of_the_host_s_tenant(world: World, db: None) -> None:
    charlie = prefix_of(world.tokens["charlie"])
    # The connection's path is globex's, where charlie's token lives.
    assert selectors.tenant_enter_reading(HOST_B, token_read_sql, [charlie])[1] is not None
    # An unknown host sets no path: the read, under globex's path still, must find nothing.
    assert selectors.tenant_enter_reading("nowhere.klique.test", token_read_sql, [charlie]) == (None, None)
    # A known host finds only what its own schema holds.
    tenant, row = selectors.tenant_enter_reading(HOST_A, token_read_sql, [charlie])
    assert (tenant.schema_name if tenant else None, row) == ("acme", None)
    alice = prefix_of(world.tokens["alice"])
    tenant, row = selectors.tenant_enter_reading(HOST_A, token_read_sql, [alice])
    assert row is not None
    assert alice in row


def test_the_read_itself_finds_nothing_outside_the_host_s_schema(world: World, db: None) -> None:
    # tenant_enter_reading drops a read where no tenant is found; the statement also reads nothing then,
    # though the session's path is still another tenant's.
    charlie = prefix_of(world.tokens["charlie"])
    selectors.tenant_enter_reading(HOST_B, token_read_sql, [charlie])  # globex's path on the session
    for host in ("nowhere.klique.test", "NOWHERE.klique.test", "acme.klique.test.evil", ""):
        sql, arguments = selectors.entering_statement(host, token_read_sql, [charlie])
        with connection.cursor() as cursor:
            cursor.execute(sql, arguments)
            assert cursor.fetchone() is None
            assert cursor.nextset()
            assert cursor.fetchone() is None, host


def test_the_provider_s_host_reads_only_the_provider_s_tokens(world: World, db: None) -> None:
    # Under public's path the provider's host reads the provider's own tokens, never a tenant's.
    root = prefix_of(world.tokens["root"])
    alice = prefix_of(world.tokens["alice"])
    selectors.tenant_enter_reading(HOST_A, token_read_sql, [alice])  # acme's path on the session
    tenant, row = selectors.tenant_enter_reading(HOST_PROVIDER, token_read_sql, [alice])
    assert (tenant.schema_name if tenant else None, row) == ("public", None)
    assert selectors.tenant_enter_reading(HOST_PROVIDER, token_read_sql, [root])[1] is not None


def test_an_authenticated_request_is_one_statement(api: Callable[..., APIClient], world: World) -> None:
    api("alice").get("/api/v1/me/")  # its last use is recorded (a write once a minute at most)
    api("charlie", host="b").get("/api/v1/me/")  # the connection's path is globex's
    selectors._schema_at_host.clear()  # acme's host not seen yet: looked up, in two statements
    for looked_up in (True, False):
        with CaptureQueriesContext(connection) as queries:
            assert api("alice").get("/api/v1/me/").json()["username"] == "alice"
        # Under the test's own transaction the request's transaction is a savepoint; BEGIN and COMMIT are
        # sent only with the first statement inside it, and there is none.
        [statement] = [query["sql"] for query in queries.captured_queries if "SAVEPOINT" not in query["sql"]]
        assert "set_config('search_path'" in statement
        assert "accounts_apitoken" in statement
        # Looked up: the guard on the second statement; seen before: the schema's tables named in full.
        assert ("current_schema()" in statement) is looked_up
        assert ('"acme".accounts_apitoken' in statement) is not looked_up
    # Without a bearer token the request reads no token.
    with CaptureQueriesContext(connection) as queries:
        assert APIClient(HTTP_HOST=HOST_A).get("/api/v1/me/").status_code == 401
    assert not any("accounts_apitoken" in query["sql"] for query in queries.captured_queries)
