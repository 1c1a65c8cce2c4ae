"""API tokens: hashed at rest, shown once, prefixed, expiring, revocable at once, bound to one tenant."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import ApiToken, User
from apps.accounts.services import token_create, token_purge_expired
from apps.accounts.tasks import token_purge_expired as token_purge_task
from tenants.models import TokenRoute
from tests.world import HOST_A, World


def bearer(token: str, host: str = HOST_A) -> APIClient:
    return APIClient(HTTP_HOST=host, HTTP_AUTHORIZATION=f"Bearer {token}")


def test_token_is_shown_once_and_stored_only_as_a_hash(api: Callable[..., APIClient], world: World) -> None:
    created = api("bob").post("/api/v1/tokens/", {"name": "laptop", "expires_in_days": 7}, format="json")
    assert created.status_code == 201
    body = created.json()
    secret = body["token"]
    assert secret.startswith(body["prefix"] + "_")
    assert body["prefix"].startswith("klq_")

    with schema_context("acme"):
        row = ApiToken.objects.get(pk=body["id"])
    assert row.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in {str(value) for value in vars(row).values()}

    listed = api("bob").get("/api/v1/tokens/").json()["results"]
    assert body["id"] in {token["id"] for token in listed}
    assert all("token" not in token for token in listed)
    assert secret not in api("bob").get(f"/api/v1/tokens/{body['id']}/").content.decode()

    assert bearer(secret).get("/api/v1/me/").json()["username"] == "bob"


def test_revocation_takes_effect_on_the_next_request(api: Callable[..., APIClient], world: World) -> None:
    assert bearer(world.tokens["bob"]).get("/api/v1/me/").status_code == 200
    assert api("bob").delete(f"/api/v1/tokens/{world.token_ids['bob']}/").status_code == 204
    refused = bearer(world.tokens["bob"]).get("/api/v1/me/")
    assert refused.status_code == 401
    assert "was revoked" in refused.json()["detail"]
    [recorded] = api("alice").get("/api/v1/audit/", {"action": "token.rejected"}).json()["results"]
    prefix = world.tokens["bob"].split("_")[1]
    assert (recorded["actor"], recorded["target"]) == (f"klq_{prefix}", "GET /api/v1/me/")
    assert "was revoked" in recorded["detail"]["reason"]
    assert world.tokens["bob"] not in str(recorded)  # the prefix names it; the token is never kept


def test_a_tenant_admin_may_revoke_anyone_s_token_and_a_member_only_their_own(
    api: Callable[..., APIClient], world: World
) -> None:
    assert api("bob").delete(f"/api/v1/tokens/{world.token_ids['dave']}/").status_code == 404
    assert api("alice").delete(f"/api/v1/tokens/{world.token_ids['dave']}/").status_code == 204
    assert bearer(world.tokens["dave"]).get("/api/v1/me/").status_code == 401


def test_expired_token_is_refused_with_its_date(world: World, db: None) -> None:
    with schema_context("acme"):
        ApiToken.objects.filter(pk=world.token_ids["dave"]).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
    refused = bearer(world.tokens["dave"]).get("/api/v1/me/")
    assert refused.status_code == 401
    assert "expired on" in refused.json()["detail"]
    assert "Create a new one" in refused.json()["detail"]


def test_token_of_a_deactivated_account_is_refused(api: Callable[..., APIClient], world: World) -> None:
    deactivated = api("alice").patch(
        f"/api/v1/users/{world.users['bob']}/", {"is_active": False}, format="json"
    )
    assert deactivated.status_code == 200
    refused = bearer(world.tokens["bob"]).get("/api/v1/me/")
    assert refused.status_code == 401
    assert "deactivated" in refused.json()["detail"]


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        ("Bearer nonsense", "Malformed token"),
        ("Bearer klq_abcdefgh_" + "x" * 32, "no such token"),
        ("Bearer ", "Malformed token"),
    ],
)
def test_malformed_or_unknown_tokens_are_explained(
    world: World, db: None, header: str, fragment: str
) -> None:
    response = APIClient(HTTP_HOST=HOST_A, HTTP_AUTHORIZATION=header).get("/api/v1/me/")
    assert response.status_code == 401
    assert fragment in response.json()["detail"]


def test_a_token_works_only_at_its_own_tenant(world: World, db: None) -> None:
    refused = bearer(world.tokens["charlie"]).get("/api/v1/me/")
    assert refused.status_code == 401
    assert "belongs to another tenant" in refused.json()["detail"]


def test_a_forged_secret_with_a_real_prefix_learns_nothing_about_the_owner(world: World, db: None) -> None:
    prefix = world.tokens["charlie"].split("_")[1]
    forged = f"klq_{prefix}_" + "A" * 32
    refused = bearer(forged).get("/api/v1/me/")
    assert refused.status_code == 401
    assert "another tenant" not in refused.json()["detail"]


def test_token_lifetime_is_bounded(api: Callable[..., APIClient], world: World) -> None:
    response = api("bob").post("/api/v1/tokens/", {"name": "forever", "expires_in_days": 5000}, format="json")
    assert response.status_code == 400
    assert "between 1 and 365 days" in response.json()["detail"]


def test_last_used_is_recorded(world: World, db: None) -> None:
    bearer(world.tokens["dave"]).get("/api/v1/me/")
    with schema_context("acme"):
        assert ApiToken.objects.get(pk=world.token_ids["dave"]).last_used_at is not None


def test_service_account_acts_only_through_its_tokens(api: Callable[..., APIClient], world: World) -> None:
    issued = api("alice").post(
        f"/api/v1/service-accounts/{world.service_account_a}/tokens/", {"name": "ci"}, format="json"
    )
    assert issued.status_code == 201
    robot = bearer(issued.json()["token"])
    me = robot.get("/api/v1/me/").json()
    assert (me["username"], me["kind"], me["role"]) == ("ci-bot", "service", "member")
    assert robot.post("/api/v1/users/", {"username": "mallory"}, format="json").status_code == 403
    # Service accounts are listed apart from people.
    people = {user["username"] for user in api("alice").get("/api/v1/users/").json()["results"]}
    assert "ci-bot" not in people


def test_purge_deletes_long_dead_tokens_and_their_index_entries(world: World, db: None) -> None:
    with schema_context("acme"):
        bob = User.objects.get(username="bob")
        old = token_create(tenant=world.tenant_a, user=bob, name="old")
        ApiToken.objects.filter(pk=old.token.pk).update(expires_at=timezone.now() - timedelta(days=31))
        assert token_purge_expired() == 1
        assert not ApiToken.objects.filter(pk=old.token.pk).exists()
    assert not TokenRoute.objects.filter(prefix=old.token.prefix).exists()


def test_purge_task_runs_in_the_schema_it_is_given(world: World, db: None) -> None:
    """The Celery task takes the schema name explicitly; B's stale token stays when A is purged."""
    stale = timezone.now() - timedelta(days=40)
    with schema_context("acme"):
        ApiToken.objects.filter(pk=world.token_ids["dave"]).update(revoked_at=stale)
    with schema_context("globex"):
        charlie = User.objects.get(username="charlie")
        b_token = token_create(tenant=world.tenant_b, user=charlie, name="stale")
        ApiToken.objects.filter(pk=b_token.token.pk).update(revoked_at=stale)
    assert token_purge_task.apply(args=("acme",)).get() == 1
    with schema_context("globex"):
        assert ApiToken.objects.filter(pk=b_token.token.pk).exists()
    assert token_purge_task.apply(args=("gone_tenant",)).get() is None
