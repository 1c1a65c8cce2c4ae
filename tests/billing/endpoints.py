"""The provider's billing endpoints, declared for the battery (tests/battery.py). The world has no Stripe
configured, so export and reconciliation say so (tests/billing/test_stripe.py runs them against one)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.battery import Endpoint, fixed

LAST_MONTH = f"{(datetime.now(UTC).date().replace(day=1) - timedelta(days=1)):%Y-%m}"

ENDPOINTS = [
    Endpoint(
        "POST",
        "api/v1/provider/billing/export/",
        "provider",
        fixed("/api/v1/provider/billing/export/"),
        body=lambda w: {"period": LAST_MONTH},
        bad_body={"period": "last month"},
        expect=400,
    ),
    Endpoint("GET", "api/v1/provider/billing/pushes/", "provider", fixed("/api/v1/provider/billing/pushes/")),
    Endpoint("GET", "api/v1/provider/billing/prices/", "provider", fixed("/api/v1/provider/billing/prices/")),
    Endpoint(
        "PUT",
        "api/v1/provider/billing/prices/",
        "provider",
        fixed("/api/v1/provider/billing/prices/"),
        body=lambda w: {"gpu_hour": {"H100": "3.10", "*": "1.20"}, "tokens_million": {}, "gb_month": "0.02"},
        bad_body={"gpu_hour": {"H100": "1E+400"}},
    ),
    Endpoint(
        "GET",
        "api/v1/provider/billing/reconciliation/",
        "provider",
        fixed(f"/api/v1/provider/billing/reconciliation/?period={LAST_MONTH}"),
        expect=400,
    ),
]
