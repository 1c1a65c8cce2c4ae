"""Token scopes (read, submit, admin) and delegated tokens for AI agents acting for a user."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from tests.scheduling.config import acme_document
from tests.world import HOST_A, World

pytestmark = pytest.mark.django_db


def with_token(token: str) -> APIClient:
    client = APIClient(HTTP_HOST=HOST_A)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def issue(client: APIClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/api/v1/tokens/", {"name": "scoped", **fields}, format="json")
    assert response.status_code == 201, response.content
    issued: dict[str, Any] = response.json()
    return issued


TASK = {"compute_resource": "Research: 4 GPUs", "name": "t", "spec": {"command": ["true"]}}


@pytest.mark.parametrize(
    ("scope", "submits", "edits_configuration"),
    [("read", False, False), ("submit", True, False), ("admin", True, True)],
)
def test_a_token_acts_with_the_lesser_of_its_scope_and_its_users_role(
    api: Callable[..., APIClient], world: World, scope: str, submits: bool, edits_configuration: bool
) -> None:
    token = with_token(issue(api("alice"), scope=scope)["token"])  # alice is a tenant admin
    assert token.get("/api/v1/tasks/").status_code == 200  # every scope reads
    submitted = token.post("/api/v1/tasks/", TASK, format="json")
    assert submitted.status_code == (201 if submits else 403), submitted.content
    if not submits:
        assert f"has scope {scope}" in submitted.json()["detail"]
    saved = token.put("/api/v1/configuration/draft/", {"document": acme_document()}, format="json")
    assert saved.status_code == (200 if edits_configuration else 403)
    if scope == "submit":
        assert "It may read and submit or cancel tasks." in saved.json()["detail"]
        cancelled = token.post(f"/api/v1/tasks/{submitted.json()['id']}/cancel/")
        assert cancelled.status_code == 200


def test_a_scope_never_lifts_a_role(api: Callable[..., APIClient], world: World) -> None:
    viewer = with_token(issue(api("dave"), scope="admin")["token"])
    assert viewer.post("/api/v1/tasks/", TASK, format="json").status_code == 403  # dave is a viewer


def test_an_agent_acts_for_its_user_within_its_own_quota_and_is_named_for_it(
    api: Callable[..., APIClient], world: World
) -> None:
    bob = api("bob")
    refused = bob.post("/api/v1/tokens/", {"name": "x", "agent": "copilot", "scope": "admin"}, format="json")
    assert refused.status_code == 400
    assert "scope read or submit" in str(refused.json())
    issued = issue(bob, agent="research-assistant", scope="submit", gpu_quota="4")
    assert (issued["agent"], issued["scope"], issued["gpu_quota"]) == ("research-assistant", "submit", "4")
    agent = with_token(issued["token"])

    first = agent.post("/api/v1/tasks/", TASK, format="json")
    assert first.status_code == 201, first.content
    assert (first.json()["submitter"], first.json()["submitted_by_agent"]) == ("bob", "research-assistant")
    history = bob.get(f"/api/v1/tasks/{first.json()['id']}/history/").json()
    assert history[0]["actor"] == "agent research-assistant for bob"

    over = agent.post("/api/v1/tasks/", TASK, format="json")  # 4 more GPUs would make 8
    assert over.status_code == 400
    assert over.json()["detail"] == (
        "Agent research-assistant's quota is 4 GPUs of unfinished tasks; it holds 4 GPUs and asks for "
        "4 GPUs more. Wait for its tasks to end, or ask bob for a larger quota."
    )
    assert bob.post("/api/v1/tasks/", TASK, format="json").status_code == 201  # bob's own work is not capped

    assert agent.post(f"/api/v1/tasks/{first.json()['id']}/cancel/").status_code == 200
    assert agent.post("/api/v1/tasks/", TASK, format="json").status_code == 201  # room again
    beyond = agent.post("/api/v1/secrets/", {"name": "X", "value": "y"}, format="json")
    assert beyond.status_code == 403
    assert "agent research-assistant's token has scope submit" in beyond.json()["detail"]

    events = (
        api("alice").get("/api/v1/audit/", {"actor": "agent research-assistant for bob"}).json()["results"]
    )
    assert {event["action"] for event in events} >= {"task-list.post", "task-cancel.post", "token.refused"}
    [refusal] = [event for event in events if event["action"] == "token.refused"]
    assert refusal["target"] == "POST /api/v1/secrets/"
    assert "has scope submit" in refusal["detail"]["reason"]
    assert {event["on_behalf_of"] for event in events} == {"bob"}


def test_service_accounts_get_scoped_expiring_tokens_for_automation(
    api: Callable[..., APIClient], world: World
) -> None:
    alice = api("alice")
    issued = alice.post(
        f"/api/v1/service-accounts/{world.service_account_a}/tokens/",
        {"name": "ci", "scope": "read", "expires_in_days": 7},
        format="json",
    )
    assert issued.status_code == 201, issued.content
    assert issued.json()["scope"] == "read"
    ci = with_token(issued.json()["token"])
    assert ci.get("/api/v1/compute-resources/").status_code == 200
    refused = ci.post("/api/v1/tasks/", TASK, format="json")
    assert refused.status_code == 403
    assert "has scope read" in refused.json()["detail"]
    assert "It may only read." in refused.json()["detail"]
