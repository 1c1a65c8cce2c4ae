"""Runs the API battery (tests/battery.py) over every declared endpoint, and checks that every endpoint
the URL configuration serves is declared."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from tests.accounts.endpoints import ENDPOINTS as ACCOUNTS
from tests.battery import ROLE_HOLDERS, Endpoint
from tests.billing.endpoints import ENDPOINTS as BILLING
from tests.catalogue.endpoints import ENDPOINTS as CATALOGUE
from tests.gateway.endpoints import ENDPOINTS as GATEWAY
from tests.metering.endpoints import ENDPOINTS as METERING
from tests.scheduling.endpoints import ENDPOINTS as SCHEDULING
from tests.tenants.endpoints import ENDPOINTS as TENANTS
from tests.vault.endpoints import ENDPOINTS as VAULT
from tests.world import World

ENDPOINTS: list[Endpoint] = [
    *ACCOUNTS, *TENANTS, *SCHEDULING, *VAULT, *GATEWAY, *METERING, *BILLING, *CATALOGUE,
]  # fmt: skip
BY_ID = {f"{endpoint.site}:{endpoint.key}": endpoint for endpoint in ENDPOINTS}
WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def call(client: APIClient, endpoint: Endpoint, world: World, body: dict[str, Any] | None = None) -> Any:
    if body is None and endpoint.body is not None:
        body = endpoint.body(world)
    method = getattr(client, endpoint.method.lower())
    return (
        method(endpoint.path(world), body, format="json")
        if endpoint.method in WRITE_METHODS
        else method(endpoint.path(world))
    )


def home_host(endpoint: Endpoint) -> str:
    return "provider" if endpoint.site == "provider" else "a"


def readable(response: Any) -> str:
    detail = response.json().get("detail")
    assert isinstance(detail, str), response.content
    assert len(detail) >= 15, f"too terse to help anyone: {detail!r}"
    return detail


@pytest.mark.parametrize("endpoint_id", sorted(BY_ID))
def test_refused_without_a_token(endpoint_id: str, api: Callable[..., APIClient], world: World) -> None:
    endpoint = BY_ID[endpoint_id]
    response = call(api(None, host=home_host(endpoint)), endpoint, world)
    assert response.status_code == 401, response.content
    assert "Bearer" in response["WWW-Authenticate"]
    readable(response)


@pytest.mark.parametrize("endpoint_id", sorted(k for k, e in BY_ID.items() if ROLE_HOLDERS[e.role][1]))
def test_forbidden_without_the_role(endpoint_id: str, api: Callable[..., APIClient], world: World) -> None:
    endpoint = BY_ID[endpoint_id]
    short_of_it = ROLE_HOLDERS[endpoint.role][1]
    response = call(api(short_of_it, host=home_host(endpoint)), endpoint, world)
    assert response.status_code == 403, response.content
    readable(response)


@pytest.mark.parametrize("endpoint_id", sorted(k for k, e in BY_ID.items() if e.site == "tenant"))
def test_another_tenant_finds_nothing(endpoint_id: str, api: Callable[..., APIClient], world: World) -> None:
    """charlie is admin of tenant B: at B's address, A's objects do not exist for him."""
    endpoint = BY_ID[endpoint_id]
    response = call(api("charlie"), endpoint, world)
    if endpoint.names_object:
        assert response.status_code == 404, response.content
        readable(response)
    else:
        # A write may name A's objects in its body (a group's members): B is told they do not exist.
        assert response.status_code < 300 or response.status_code in (400, endpoint.expect), response.content
        for a_id in endpoint.a_ids(world):
            assert a_id not in response.content.decode()


@pytest.mark.parametrize("endpoint_id", sorted(BY_ID))
def test_token_of_another_tenant_is_refused(
    endpoint_id: str, api: Callable[..., APIClient], world: World
) -> None:
    endpoint = BY_ID[endpoint_id]
    stranger = "root" if endpoint.site == "tenant" else "alice"
    response = call(api(stranger, host=home_host(endpoint)), endpoint, world)
    assert response.status_code == 401, response.content
    assert "another tenant" in readable(response)


@pytest.mark.parametrize("endpoint_id", sorted(k for k, e in BY_ID.items() if e.bad_body is not None))
def test_bad_input_is_explained(endpoint_id: str, api: Callable[..., APIClient], world: World) -> None:
    endpoint = BY_ID[endpoint_id]
    response = call(
        api(ROLE_HOLDERS[endpoint.role][0], host=home_host(endpoint)), endpoint, world, endpoint.bad_body
    )
    assert response.status_code == 400, response.content
    readable(response)


@pytest.mark.parametrize("endpoint_id", sorted(BY_ID))
def test_allowed_for_the_role(endpoint_id: str, api: Callable[..., APIClient], world: World) -> None:
    endpoint = BY_ID[endpoint_id]
    holder = endpoint.owner or ROLE_HOLDERS[endpoint.role][0]
    response = call(api(holder, host=home_host(endpoint)), endpoint, world)
    assert response.status_code == endpoint.expect, response.content


def _routes(patterns: list[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _routes(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            yield prefix + str(pattern.pattern), pattern.callback


@pytest.mark.parametrize(("site", "urlconf"), [("tenant", "config.urls"), ("provider", "config.urls_public")])
def test_every_endpoint_is_declared(site: str, urlconf: str) -> None:
    declared = {e.key for e in ENDPOINTS if e.site == site}
    served = set()
    for route, callback in _routes(get_resolver(urlconf).url_patterns):
        view_class = getattr(callback, "view_class", None)
        if not route.startswith("api/v1/") or view_class is None:
            continue
        for method in ("get", "post", "put", "patch", "delete"):
            if hasattr(view_class, method):
                served.add(f"{method.upper()} /{route}")
    assert served, "no API routes found"
    assert served - declared == set(), "endpoints missing from the battery"
    assert declared - served == set(), "declared endpoints that are not served"


# The role matrix: every tenant endpoint, called by each tenant role. A role at or above the endpoint's
# gets its answer; one below is refused with 403 and a sentence. (The project-admin and provider
# endpoints are checked above with their holders and those one step short.)
RANK = {"viewer": 0, "member": 1, "admin": 2}
PERSONAS = {"dave": "viewer", "bob": "member", "alice": "admin"}


@pytest.mark.parametrize(
    ("endpoint_id", "persona"),
    sorted(
        (key, persona)
        for key, e in BY_ID.items()
        if e.site == "tenant" and e.role in RANK
        for persona in PERSONAS
    ),
)
def test_the_role_matrix(endpoint_id: str, persona: str, api: Callable[..., APIClient], world: World) -> None:
    endpoint = BY_ID[endpoint_id]
    response = call(api(persona), endpoint, world)
    if endpoint.owner not in (None, persona) and PERSONAS[persona] != "admin":
        assert response.status_code == endpoint.others, response.content  # someone else's
        readable(response)
    elif RANK[PERSONAS[persona]] >= RANK[endpoint.role]:
        assert response.status_code == endpoint.expect, response.content
    else:
        assert response.status_code == 403, response.content
        readable(response)
