"""A fuzz of the API against its own OpenAPI schema: schemathesis generates requests for every operation
(valid by the schema, and not), sent in-process through the WSGI app as alice, the tenant's admin, each
operation's cases inside a savepoint that is rolled back. No request gets a 500.

(schemathesis's own pytest plugin does not load under pytest 9, so its strategies drive Hypothesis here.)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, transaction
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.world import HOST_A, HOST_PROVIDER, World

pytestmark = pytest.mark.django_db

APP = get_wsgi_application()
EXAMPLES = 20
STATUSES: dict[str, list[int]] = {}


@pytest.fixture
def in_transaction() -> Iterator[None]:
    """Requests through the WSGI app stay in the test's transaction, as Django's test client keeps them:
    it does not close the connection at each request's start and end."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


class Rollback(Exception):
    pass


def known_objects(world: World) -> dict[str, str]:
    """Path parameters that name the world's objects, so that requests reach the logic behind a 404."""
    return {
        "task_id": world.task_a, "pool_id": world.pool_a, "project_id": world.project_a,
        "group_id": world.group_a, "secret_id": world.secret_a, "budget_id": world.wallet_a,
        "account_id": world.service_account_a, "resource_id": world.compute_resource_a,
        "token_id": world.token_ids["carol"], "user_id": world.users["bob"], "name": "result.txt",
        "period": "2026-11",
    }  # fmt: skip


def _fuzz(
    operation: Any,
    mode: GenerationMode,
    known: dict[str, str],
    headers: dict[str, str],
    failures: list[str],
    examples: int = EXAMPLES,
) -> None:
    names = re.findall(r"{(\w+)}", operation.path)
    fixed = {name: known[name] for name in names if name in known} or None

    @given(case=operation.as_strategy(mode, path_parameters=fixed))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def run(case: Any) -> None:
        response = case.call(headers=headers)
        STATUSES.setdefault(f"{case.method} {operation.path}", []).append(response.status_code)
        if response.status_code >= 500:
            failures.append(
                f"{case.method} {case.formatted_path} query={case.query} body={str(case.body)[:300]} -> "
                f"{response.status_code} {response.text[:300]}"
            )

    with contextlib.suppress(Rollback), transaction.atomic():
        run()
        raise Rollback


def test_no_request_to_the_tenant_api_gets_a_500(world: World, in_transaction: None) -> None:
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", APP, headers={"Host": HOST_A})
    headers = {"Host": HOST_A, "Authorization": f"Bearer {world.tokens['alice']}"}
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) > 60
    known = known_objects(world)
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation, mode, known, headers, failures)
    assert failures == [], "\n".join(failures)
    # The fuzz reached the logic behind authentication and lookups, not only their refusals.
    answered = {key for key, codes in STATUSES.items() if any(code < 300 for code in codes)}
    assert len(answered) >= 60, sorted(set(STATUSES) - answered)


def test_no_request_to_the_provider_api_gets_a_500(world: World, in_transaction: None) -> None:
    """As root, the provider's admin, at the base domain. Creating a tenant migrates a schema (seconds
    each), so that operation gets a few cases only; `slug` names tenant B, whose changes roll back."""
    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", APP, headers={"Host": HOST_PROVIDER})
    headers = {"Host": HOST_PROVIDER, "Authorization": f"Bearer {world.tokens['root']}"}
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) > 10
    known = {"slug": "globex", "token_id": world.token_ids["paula"]}
    for operation in operations:
        slow = operation.method.upper() == "POST" and operation.path.endswith("/provider/tenants/")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation, mode, known, headers, failures, examples=3 if slow else EXAMPLES)
    assert failures == [], "\n".join(failures)
    provider = {key: codes for key, codes in STATUSES.items() if "/provider/" in key}
    answered = {key for key, codes in provider.items() if any(code < 300 for code in codes)}
    assert len(answered) >= 10, sorted(set(provider) - answered)
