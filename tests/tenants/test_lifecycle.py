"""Creating, suspending, resuming and deleting tenants, through the provider's API and services."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import connection
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import User
from apps.core.errors import Conflict, InvalidInput
from apps.provider import services
from tenants.models import Domain, Tenant, TokenRoute
from tests.world import World


def schema_exists(name: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM information_schema.schemata WHERE schema_name = %s", [name])
        return cursor.fetchone() is not None


def test_provider_creates_a_tenant_that_works_at_once(api: Callable[..., APIClient], world: World) -> None:
    response = api("root").post(
        "/api/v1/provider/tenants/",
        {
            "slug": "initech",
            "name": "Initech",
            "admin_username": "peter",
            "admin_email": "peter@initech.test",
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["domains"] == ["initech.klique.test"]
    assert response["Cache-Control"] == "no-store"
    assert schema_exists("initech")
    with schema_context("initech"):
        assert User.objects.get(username="peter").role == "admin"

    peter = APIClient(HTTP_HOST="initech.klique.test", HTTP_AUTHORIZATION=f"Bearer {body['admin_token']}")
    tenant = peter.get("/api/v1/tenant/")
    assert tenant.status_code == 200
    assert tenant.json()["slug"] == "initech"
    # The new tenant's schema holds its own people only.
    usernames = {user["username"] for user in peter.get("/api/v1/users/").json()["results"]}
    assert usernames == {"peter"}


def test_tenant_creation_is_all_or_nothing(world: World, db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the schema exists (here: issuing the admin's token) leaves no row, schema or domain."""

    def broken_token_create(**kwargs: object) -> None:
        raise RuntimeError("token store unavailable")

    monkeypatch.setattr("apps.accounts.services.token_create", broken_token_create)
    with pytest.raises(RuntimeError, match="token store unavailable"):
        services.tenant_create(slug="doomed", name="Doomed", admin_username="dora")
    assert not Tenant.objects.filter(slug="doomed").exists()
    assert not Domain.objects.filter(domain="doomed.klique.test").exists()
    assert not schema_exists("doomed")


@pytest.mark.parametrize(
    ("slug", "fragment"),
    [("Acme Corp", "lowercase letters"), ("x", "3 to 40"), ("public", "reserved"), ("ends-", "hyphen")],
)
def test_bad_slugs_are_refused_before_anything_is_made(
    world: World, db: None, slug: str, fragment: str
) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        services.tenant_create(slug=slug, name="", admin_username="someone")
    assert not Tenant.objects.filter(name=slug).exists()


def test_a_taken_slug_is_a_conflict(world: World, db: None) -> None:
    with pytest.raises(Conflict, match="already exists"):
        services.tenant_create(slug="acme", name="Acme again", admin_username="eve")


def test_suspended_tenant_gets_403_with_the_reason(api: Callable[..., APIClient], world: World) -> None:
    suspended = api("root").post(
        "/api/v1/provider/tenants/acme/suspend/", {"reason": "The October invoice is unpaid."}, format="json"
    )
    assert suspended.status_code == 200
    assert suspended.json()["status"] == "suspended"

    refused = api("alice").get("/api/v1/tenant/")
    assert refused.status_code == 403
    detail = refused.json()["detail"]
    assert "suspended" in detail
    assert "The October invoice is unpaid." in detail
    assert "Contact your platform provider" in detail
    # Another tenant is untouched.
    assert api("charlie").get("/api/v1/tenant/").status_code == 200

    assert api("root").post("/api/v1/provider/tenants/acme/resume/").status_code == 200
    assert api("alice").get("/api/v1/tenant/").status_code == 200


def test_deleting_a_tenant_drops_its_schema_domains_and_tokens(
    api: Callable[..., APIClient], world: World
) -> None:
    assert api("root").delete("/api/v1/provider/tenants/acme/").status_code == 204
    assert not schema_exists("acme")
    assert not Domain.objects.filter(domain="acme.klique.test").exists()
    assert not TokenRoute.objects.filter(tenant__slug="acme").exists()
    gone = api("alice").get("/api/v1/tenant/")
    assert gone.status_code == 404
    assert "No tenant is served at 'acme.klique.test'" in gone.json()["detail"]


def test_unknown_domain_is_a_404_that_explains(api: Callable[..., APIClient]) -> None:
    response = APIClient(HTTP_HOST="nowhere.klique.test").get("/api/v1/tenant/")
    assert response.status_code == 404
    assert "Tenants are reached at <tenant>.klique.test" in response.json()["detail"]


def test_provider_routes_do_not_exist_on_a_tenant_domain(api: Callable[..., APIClient]) -> None:
    assert api("alice").get("/api/v1/provider/tenants/").status_code == 404


def test_gpu_share_is_set_by_the_provider(api: Callable[..., APIClient], world: World) -> None:
    response = api("root").patch("/api/v1/provider/tenants/globex/", {"gpu_share": 48}, format="json")
    assert response.json()["gpu_share"] == 48
    assert api("charlie").get("/api/v1/tenant/").json()["gpu_share"] == 48
    lifted = api("root").patch("/api/v1/provider/tenants/globex/", {"gpu_share": None}, format="json")
    assert lifted.json()["gpu_share"] is None


def test_public_tenant_is_not_listed_or_deletable(api: Callable[..., APIClient], world: World) -> None:
    slugs = {tenant["slug"] for tenant in api("root").get("/api/v1/provider/tenants/").json()}
    assert slugs >= {"acme", "globex"}
    assert "public" not in slugs
    assert api("root").delete("/api/v1/provider/tenants/public/").status_code == 404
    with pytest.raises(InvalidInput, match="cannot be deleted"):
        services.tenant_delete(tenant=world.public)
