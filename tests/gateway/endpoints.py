"""The gateway's REST endpoints, declared for the battery (tests/battery.py). The OpenAI-compatible
endpoints (/v1/...) are not Django's: tests/gateway/test_openai_api.py covers them with the openai client."""

from __future__ import annotations

from tests.battery import Endpoint, fixed

CHAT = {
    "model_name": "chat",
    "litellm_params": {
        "model": "openai/echo",
        "api_base": "http://127.0.0.1:9/v1",
        "api_key_secret": "SHARED_TOKEN",
    },
}

ENDPOINTS = [
    Endpoint("GET", "api/v1/gateway/", "admin", fixed("/api/v1/gateway/")),
    Endpoint(
        "PUT",
        "api/v1/gateway/",
        "admin",
        fixed("/api/v1/gateway/"),
        body=lambda w: {"document": {"model_list": [CHAT]}},
        bad_body={"document": {"model_list": [{"model_name": "chat", "litellm_params": {"model": "gpt"}}]}},
    ),
    Endpoint(
        "GET",
        "api/v1/gateway/budgets/",
        "viewer",
        fixed("/api/v1/gateway/budgets/"),
        a_ids=lambda w: [w.wallet_a],
    ),
    Endpoint(
        "POST",
        "api/v1/gateway/budgets/",
        "admin",
        fixed("/api/v1/gateway/budgets/"),
        body=lambda w: {
            "scope": "project",
            "project": "apollo",
            "unit": "tokens",
            "limit": 100000,
            "period": "day",
        },
        bad_body={"scope": "project", "project": "nowhere", "limit": 5},
        expect=201,
    ),
    Endpoint(
        "GET",
        "api/v1/gateway/budgets/<uuid:budget_id>/",
        "viewer",
        lambda w: f"/api/v1/gateway/budgets/{w.wallet_a}/",
        names_object=True,
    ),
    Endpoint(
        "PATCH",
        "api/v1/gateway/budgets/<uuid:budget_id>/",
        "admin",
        lambda w: f"/api/v1/gateway/budgets/{w.wallet_a}/",
        body=lambda w: {"limit": "250.5"},
        bad_body={"limit": "-1"},
        names_object=True,
    ),
    Endpoint(
        "DELETE",
        "api/v1/gateway/budgets/<uuid:budget_id>/",
        "admin",
        lambda w: f"/api/v1/gateway/budgets/{w.wallet_a}/",
        names_object=True,
        expect=204,
    ),
    Endpoint(
        "POST",
        "api/v1/gateway/budgets/<uuid:budget_id>/top-up/",
        "admin",
        lambda w: f"/api/v1/gateway/budgets/{w.wallet_a}/top-up/",
        body=lambda w: {"amount": "25"},
        bad_body={"amount": "-5"},
        names_object=True,
    ),
    Endpoint(
        "GET", "api/v1/gateway/usage/", "viewer", fixed("/api/v1/gateway/usage/"), a_ids=lambda w: [w.usage_a]
    ),
]
