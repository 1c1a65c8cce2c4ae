"""The AI agents acting for a user, through the API: each delegated token with what it submitted, holds
now and spent (GPU-hours and gateway tokens, from the ledger), and revoking one at once."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import ApiToken, User
from apps.metering.models import PriceBook
from apps.metering.runs import run_segment
from apps.resources.models import Pool
from apps.scheduling.models import Task
from gateway.models import Usage
from gateway.services import meter_calls
from tests.world import HOST_A, World

pytestmark = pytest.mark.django_db

TASK = {"compute_resource": "Research: 4 GPUs", "spec": {"command": ["true"]}}


def with_token(token: str) -> APIClient:
    client = APIClient(HTTP_HOST=HOST_A)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def delegate(client: APIClient, agent: str, **fields: Any) -> dict[str, Any]:
    body = {"name": agent, "agent": agent, "scope": "submit", **fields}
    issued = client.post("/api/v1/tokens/", body, format="json")
    assert issued.status_code == 201, issued.content
    answer: dict[str, Any] = issued.json()
    return answer


def ran(task_id: str, *, hours: int, units: int) -> None:
    """A run of `task_id` metered as the lifecycle meters it."""
    task = Task.objects.get(pk=task_id)
    ended = timezone.now()
    run_segment(
        task_id=str(task.pk),
        started_at=ended - timedelta(hours=hours),
        ended_at=ended,
        user_id=str(task.submitter_id),
        project_id="",
        group="research",
        pool_id=str(Pool.objects.get(name="h100").pk),
        compute_resource=task.compute_resource_name,
        units=units,
    )


def called(token: dict[str, Any], *, tokens_in: int, tokens_out: int, cost_nano: int) -> None:
    """A gateway call made with `token`, as the gateway writes it, then moved into the ledger."""
    bob = User.objects.get(username="bob")
    Usage.objects.create(
        request_id=f"req-{uuid.uuid4().hex}",
        at=timezone.now(),
        user_id=bob.pk,
        username="bob",
        token_prefix=token["token"].split("_")[1],
        agent=token["agent"],
        endpoint="chat.completions",
        model="chat",
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        cost_nano_usd=cost_nano,
    )


def by_agent(client: APIClient) -> dict[str, dict[str, Any]]:
    listed = client.get("/api/v1/delegations/")
    assert listed.status_code == 200, listed.content
    return {row["agent"]: row for row in listed.json()["results"]}


def test_each_agent_acting_for_a_user_shows_what_it_submitted_holds_and_spent(
    api: Callable[..., APIClient], world: World
) -> None:
    bob = api("bob")
    claude = delegate(bob, "claude", gpu_quota="8")
    idle = delegate(bob, "idle-agent")
    agent = with_token(claude["token"])
    first = agent.post("/api/v1/tasks/", TASK, format="json").json()
    second = agent.post("/api/v1/tasks/", TASK, format="json").json()
    own = bob.post("/api/v1/tasks/", TASK, format="json").json()  # bob's own: not the agent's
    with schema_context("acme"):
        made = timezone.now() - timedelta(days=1)  # the agents have worked for a day
        ApiToken.objects.filter(pk__in=[claude["id"], idle["id"]]).update(created_at=made)
        PriceBook.objects.update_or_create(pk=1, defaults={"gpu_hour": {"H100": "2.00"}})
        ran(first["id"], hours=2, units=4 * 840)  # 8 GPU-hours at 2 USD
        ran(own["id"], hours=5, units=4 * 840)  # 20 GPU-hours, bob's alone
        called(claude, tokens_in=100, tokens_out=50, cost_nano=3 * 10**8)
        called(claude, tokens_in=10, tokens_out=5, cost_nano=10**8)
        called(idle, tokens_in=1, tokens_out=1, cost_nano=0)
        Usage.objects.create(  # bob's own call, with his own token
            request_id="req-bob-own", at=timezone.now(), user_id=User.objects.get(username="bob").pk,
            username="bob", token_prefix="ownownow", endpoint="chat.completions", model="chat",
            tokens_in=1000, tokens_out=1000,
        )  # fmt: skip
        meter_calls()
    assert bob.post(f"/api/v1/tasks/{second['id']}/cancel/").status_code == 200

    rows = by_agent(bob)
    assert set(rows) == {"claude", "idle-agent"}  # only delegated tokens: not bob's own
    row = rows["claude"]
    assert (row["user"], row["scope"], row["gpu_quota"], row["active"]) == ("bob", "submit", "8", True)
    assert (row["tasks_submitted"], row["tasks_unfinished"], row["holds_gpus"]) == (2, 1, "4")
    assert row["gpu_hours"] == "8.000000"
    assert (row["gateway_calls"], row["tokens_in"], row["tokens_out"]) == (2, 110, 55)
    assert row["cost_usd"] == "16.400000"  # 8 GPU-hours at 2 USD and 0.4 USD of calls
    assert row["token"] == f"klq_{claude['token'].split('_')[1]}_…"
    assert claude["token"] not in str(rows)  # the secret is never shown again
    quiet = rows["idle-agent"]
    assert (quiet["tasks_submitted"], quiet["holds_gpus"], quiet["gpu_hours"]) == (0, "0", "0.000000")
    assert (quiet["gateway_calls"], quiet["tokens_in"]) == (1, 1)
    assert bob.get(f"/api/v1/delegations/{claude['id']}/").json()["gpu_hours"] == "8.000000"


def test_a_person_sees_their_own_agents_an_admin_anyones_and_another_tenant_none(
    api: Callable[..., APIClient], world: World
) -> None:
    claude = delegate(api("bob"), "claude")
    assert "claude" not in by_agent(api("alice"))  # alice's own agents: not bob's
    everyone = api("alice").get("/api/v1/delegations/", {"everyone": "true"}).json()["results"]
    assert claude["id"] in {row["id"] for row in everyone}  # an admin can find anyone's agent, to stop it
    assert api("alice").get(f"/api/v1/delegations/{claude['id']}/").json()["user"] == "bob"
    carol_sees = api("carol").get("/api/v1/delegations/", {"everyone": "true"}).json()["results"]
    assert claude["id"] not in {row["id"] for row in carol_sees}  # everyone=true is an admin's only
    for persona, host in (("carol", None), ("charlie", None), ("bob", "b")):
        client = api(persona, host=host)
        for path in (f"/api/v1/delegations/{claude['id']}/", f"/api/v1/delegations/{claude['id']}/revoke/"):
            answer = client.post(path) if path.endswith("revoke/") else client.get(path)
            assert answer.status_code in (401, 404), (persona, path, answer.status_code)
    with schema_context("acme"):
        assert ApiToken.objects.get(pk=claude["id"]).revoked_at is None


def test_revoking_an_agent_refuses_its_next_call_and_can_cancel_what_it_left(
    api: Callable[..., APIClient], world: World
) -> None:
    bob = api("bob")
    keep, stop = delegate(bob, "keeper"), delegate(bob, "runaway")
    runaway = with_token(stop["token"])
    left = [runaway.post("/api/v1/tasks/", TASK, format="json").json()["id"] for _ in range(2)]
    kept = with_token(keep["token"]).post("/api/v1/tasks/", TASK, format="json").json()["id"]

    revoked = bob.post(f"/api/v1/delegations/{stop['id']}/revoke/", {"cancel_tasks": True}, format="json")
    assert revoked.status_code == 200, revoked.content
    body = revoked.json()
    assert (body["active"], body["cancelled_tasks"], body["tasks_unfinished"]) == (False, 2, 0)
    assert body["revoked_at"] is not None
    refused = runaway.get("/api/v1/tasks/")
    assert refused.status_code == 401
    assert "revoked" in refused.json()["detail"]
    with schema_context("acme"):
        assert set(Task.objects.filter(pk__in=left).values_list("state", flat=True)) == {"aborted"}
        assert Task.objects.get(pk=kept).state != "aborted"  # another agent's work is its own
    alone = bob.post(f"/api/v1/delegations/{keep['id']}/revoke/", {}, format="json").json()
    assert (alone["active"], alone["cancelled_tasks"], alone["tasks_unfinished"]) == (False, 0, 1)
    audit = api("alice").get("/api/v1/audit/", {"action": "delegation.revoke"}).json()["results"]
    assert {(event["actor"], event["detail"]["agent"]) for event in audit} >= {
        ("bob", "runaway"),
        ("bob", "keeper"),
    }
    not_a_flag = bob.post(
        f"/api/v1/delegations/{keep['id']}/revoke/", {"cancel_tasks": "maybe"}, format="json"
    )
    assert not_a_flag.status_code == 400
