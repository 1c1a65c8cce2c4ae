"""The usage and price book endpoints, declared for the battery (tests/battery.py)."""

from __future__ import annotations

from tests.battery import Endpoint, fixed

EVENT = {
    "event_id": "imported-1",
    "kind": "tokens",
    "started_at": "2026-11-02T10:00:00+00:00",
    "user": "bob",
    "model": "chat",
    "tokens_in": 10,
    "tokens_out": 20,
}

ENDPOINTS = [
    Endpoint("GET", "api/v1/usage/", "viewer", fixed("/api/v1/usage/"), a_ids=lambda w: [w.ledger_a]),
    Endpoint("GET", "api/v1/usage/summary/", "viewer", fixed("/api/v1/usage/summary/?by=user")),
    Endpoint(
        "POST",
        "api/v1/usage/events/",
        "admin",
        fixed("/api/v1/usage/events/"),
        body=lambda w: {"events": [EVENT]},
        bad_body={"events": "not a list"},
        expect=201,
    ),
    Endpoint("GET", "api/v1/usage/rejections/", "admin", fixed("/api/v1/usage/rejections/")),
    Endpoint("GET", "api/v1/price-book/", "viewer", fixed("/api/v1/price-book/")),
    Endpoint(
        "PUT",
        "api/v1/price-book/",
        "admin",
        fixed("/api/v1/price-book/"),
        body=lambda w: {"gpu_hour": {"H100": "2.5"}, "tokens_million": {}, "gb_month": "0.02"},
        bad_body={"gpu_hour": {"H100": "-1"}, "tokens_million": {}, "gb_month": "0"},
    ),
]

ENDPOINTS += [
    Endpoint("GET", "api/v1/usage/periods/", "viewer", fixed("/api/v1/usage/periods/")),
    Endpoint(
        "POST",
        "api/v1/usage/periods/<str:period>/close/",
        "admin",
        fixed("/api/v1/usage/periods/2026-10/close/"),
        body=lambda w: {},
    ),
    Endpoint("GET", "api/v1/usage/chargeback/", "admin", fixed("/api/v1/usage/chargeback/?period=2026-11")),
]
