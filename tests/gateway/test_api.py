"""The gateway's REST API on the test world (tenant acme): configuration checked whole, budgets and
wallets, usage that each person may read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rest_framework.test import APIClient

from tests.world import World


def test_a_configuration_lists_every_problem_at_once(api: Callable[..., APIClient]) -> None:
    document = {
        "model_list": [
            {"model_name": "chat", "litellm_params": {"model": "gpt-4o", "api_key": "sk-live-123"}},
            {"model_name": "chat", "litellm_params": {"model": "hosted_vllm/llama", "weight": 0}},
        ],
        "router_settings": {"routing_strategy": "fastest", "fallbacks": [{"chat": ["nowhere"]}]},
        "guardrails": {"pii": {"action": "shout"}, "max_tokens_cap": -1},
    }
    response = api("alice").put("/api/v1/gateway/", {"document": document}, format="json")
    assert response.status_code == 400
    message = response.json()["detail"]
    for expected in (
        "model_list[0].litellm_params.api_key: keys are never stored in the configuration",
        "model_list[0].litellm_params.model: expected '<provider>/<model>'",
        "model_list[1].litellm_params.weight: a number, above 0 and up to 1000 (got 0)",
        "model_list[1].litellm_params.api_base: a self-hosted hosted_vllm deployment needs its address",
        "router_settings.routing_strategy: one of simple-shuffle, least-busy, latency-based-routing",
        "router_settings.fallbacks[0].chat: 'nowhere' is not another model group",
        "guardrails.pii.action: one of off, redact, refuse",
        "guardrails.max_tokens_cap: expected a whole number >= 1",
    ):
        assert expected in message, message
    assert "sk-live-123" not in message


def test_a_deployment_key_must_be_in_the_vault_first(api: Callable[..., APIClient]) -> None:
    chat = {
        "model_name": "chat",
        "litellm_params": {"model": "openai/gpt-4o-mini", "api_key_secret": "OPENAI_API_KEY"},
    }
    response = api("alice").put("/api/v1/gateway/", {"document": {"model_list": [chat]}}, format="json")
    assert response.status_code == 400
    assert "No tenant secret named OPENAI_API_KEY" in response.json()["detail"]
    api("alice").post(
        "/api/v1/secrets/", {"scope": "tenant", "name": "OPENAI_API_KEY", "value": "sk-x"}, format="json"
    )
    saved = api("alice").put("/api/v1/gateway/", {"document": {"model_list": [chat]}}, format="json")
    assert saved.status_code == 200, saved.content
    assert saved.json()["updated_by"] == "alice"
    assert api("alice").get("/api/v1/gateway/").json()["document"]["model_list"] == [chat]


def test_budgets_are_seen_by_those_they_apply_to(api: Callable[..., APIClient], world: World) -> None:
    made = api("alice").post(
        "/api/v1/gateway/budgets/",
        {"scope": "user", "user": "carol", "unit": "tokens", "limit": 5000, "period": "week"},
        format="json",
    )
    assert made.status_code == 201, made.content
    assert made.json()["name"] == "carol's weekly budget"
    assert made.json()["spent"] == "0"

    def labels(persona: str) -> set[str]:
        return {row["name"] for row in api(persona).get("/api/v1/gateway/budgets/").json()["results"]}

    assert labels("carol") == {"carol's weekly budget", "the tenant's wallet"}
    assert labels("bob") == {"the tenant's wallet"}
    again = api("alice").post(
        "/api/v1/gateway/budgets/",
        {"scope": "user", "user": "carol", "unit": "tokens", "limit": 1, "period": "week"},
        format="json",
    )
    assert again.status_code == 400
    assert "already has a week budget in tokens" in again.json()["detail"]


def test_only_wallets_are_topped_up(api: Callable[..., APIClient], world: World) -> None:
    wallet = api("alice").post(
        f"/api/v1/gateway/budgets/{world.wallet_a}/top-up/", {"amount": "0.5"}, format="json"
    )
    assert wallet.status_code == 200, wallet.content
    assert wallet.json()["limit"] == "100.500000"
    monthly = (
        api("alice")
        .post(
            "/api/v1/gateway/budgets/",
            {"scope": "tenant", "unit": "usd", "limit": 10, "period": "month"},
            format="json",
        )
        .json()
    )
    refused = api("alice").post(
        f"/api/v1/gateway/budgets/{monthly['id']}/top-up/", {"amount": "5"}, format="json"
    )
    assert refused.status_code == 400
    assert "Only wallets (period none) are topped up" in refused.json()["detail"]


def test_usage_is_your_own_unless_you_are_an_admin(api: Callable[..., APIClient], world: World) -> None:
    def ids(persona: str, query: str = "") -> list[str]:
        return [
            row["request_id"] for row in api(persona).get(f"/api/v1/gateway/usage/{query}").json()["results"]
        ]

    assert ids("bob") == [world.usage_a]
    assert ids("carol") == []
    assert ids("alice", "?user=bob&project=apollo") == [world.usage_a]
    assert ids("alice", "?model=other") == []
    row: dict[str, Any] = api("bob").get("/api/v1/gateway/usage/").json()["results"][0]
    assert (row["tokens_in"], row["tokens_out"], row["cost_usd"]) == (12, 30, "0.000072")
    bad = api("alice").get("/api/v1/gateway/usage/?since=yesterday")
    assert bad.status_code == 400
