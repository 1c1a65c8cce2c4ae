"""Roles beyond what the battery covers: project admins, the last admin, and role changes taking effect."""

from __future__ import annotations

from collections.abc import Callable

from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from tests.factories import UserFactory
from tests.world import World


def test_project_admin_manages_members_of_their_project_only(
    api: Callable[..., APIClient], world: World
) -> None:
    carol = api("carol")
    added = carol.post(
        f"/api/v1/projects/{world.project_a}/members/",
        {"user": world.users["dave"], "role": "member"},
        format="json",
    )
    assert added.status_code == 200
    members = {
        m["username"]: m["role"]
        for m in carol.get(f"/api/v1/projects/{world.project_a}/members/").json()["results"]
    }
    assert members == {"alice": "admin", "bob": "member", "carol": "admin", "dave": "member"}

    # A project created by alice: carol is not its admin, so she cannot change it.
    other = api("alice").post("/api/v1/projects/", {"name": "artemis"}, format="json").json()
    refused = carol.patch(f"/api/v1/projects/{other['id']}/", {"description": "mine now"}, format="json")
    assert refused.status_code == 403
    assert "project admin" in refused.json()["detail"]
    # Nor may a project admin delete their project: that is a tenant admin's call.
    assert carol.delete(f"/api/v1/projects/{world.project_a}/").status_code == 403


def test_the_last_admin_cannot_be_demoted_or_deactivated(api: Callable[..., APIClient], world: World) -> None:
    alice = api("alice")
    demoted = alice.patch(f"/api/v1/users/{world.users['alice']}/", {"role": "member"}, format="json")
    assert demoted.status_code == 400
    assert "last active admin" in demoted.json()["detail"]
    # With a second admin it is allowed.
    assert (
        alice.patch(f"/api/v1/users/{world.users['bob']}/", {"role": "admin"}, format="json").status_code
        == 200
    )
    assert (
        alice.patch(f"/api/v1/users/{world.users['alice']}/", {"role": "member"}, format="json").status_code
        == 200
    )


def test_a_role_change_applies_to_the_next_request(api: Callable[..., APIClient], world: World) -> None:
    assert api("bob").get("/api/v1/service-accounts/").status_code == 403
    api("alice").patch(f"/api/v1/users/{world.users['bob']}/", {"role": "admin"}, format="json")
    assert api("bob").get("/api/v1/service-accounts/").status_code == 200


def test_duplicate_names_are_conflicts_with_a_reason(api: Callable[..., APIClient], world: World) -> None:
    for path, body in (
        ("/api/v1/users/", {"username": "bob"}),
        ("/api/v1/projects/", {"name": "apollo"}),
        ("/api/v1/groups/", {"name": "research"}),
        ("/api/v1/service-accounts/", {"name": "ci-bot"}),
    ):
        response = api("alice").post(path, body, format="json")
        assert response.status_code == 409, path
        assert "already exists" in response.json()["detail"]


def test_lists_are_paginated(api: Callable[..., APIClient], world: World) -> None:
    with schema_context("acme"):
        UserFactory.create_batch(3)
    first = api("alice").get("/api/v1/users/?limit=5").json()
    assert first["count"] == 7
    assert len(first["results"]) == 5
    rest = api("alice").get(first["next"].replace("http://acme.klique.test", "")).json()
    assert len(rest["results"]) == 2
    assert {u["id"] for u in first["results"]}.isdisjoint(u["id"] for u in rest["results"])


def test_project_members_see_only_their_tenant_s_people(api: Callable[..., APIClient], world: World) -> None:
    with schema_context("globex"):
        outsider = UserFactory.create()
    response = api("carol").post(
        f"/api/v1/projects/{world.project_a}/members/", {"user": str(outsider.pk)}, format="json"
    )
    assert response.status_code == 400
    assert "in this tenant" in response.json()["detail"]


def test_a_group_that_policies_use_cannot_be_deleted(api: Callable[..., APIClient], world: World) -> None:
    response = api("alice").delete(f"/api/v1/groups/{world.group_a}/")
    assert response.status_code == 409
    assert "policies research" in response.json()["detail"]
