"""The provider's billing endpoints, declared for the battery (tests/battery.py). The world has no Stripe
configured, so export and reconciliation say so (tests/billing/test_stripe.py runs them against one)."""

from __future__ import annotations

from tests.battery import Endpoint, fixed

ENDPOINTS = [
    Endpoint(
        "POST",
        "api/v1/provider/billing/export/",
        "provider",
        fixed("/api/v1/provider/billing/export/"),
        body=lambda w: {"period": "2026-10"},
        bad_body={"period": "last month"},
        expect=400,
    ),
    Endpoint("GET", "api/v1/provider/billing/pushes/", "provider", fixed("/api/v1/provider/billing/pushes/")),
    Endpoint(
        "GET",
        "api/v1/provider/billing/reconciliation/",
        "provider",
        fixed("/api/v1/provider/billing/reconciliation/?period=2026-10"),
        expect=400,
    ),
]
