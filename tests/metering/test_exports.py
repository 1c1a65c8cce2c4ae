"""Chargeback files per period, and closing a period."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pyarrow.parquet as pq
from django.utils import timezone
from rest_framework.test import APIClient

from tests.world import World

EVENTS: list[dict[str, Any]] = [
    {
        "event_id": "cb-gpu",
        "kind": "gpu",
        "started_at": "2026-11-05T08:00:00+00:00",
        "ended_at": "2026-11-05T10:00:00+00:00",
        "user": "carol",
        "project": "apollo",
        "pool": "h100",
        "gpus": "1/7",
    },
    {
        "event_id": "cb-call",
        "kind": "tokens",
        "started_at": "2026-11-05T09:00:00+00:00",
        "user": "bob",
        "model": "chat",
        "tokens_in": 1_000_000,
        "tokens_out": 2_000_000,
    },
]


def test_a_period_exports_as_csv_and_parquet_per_cost_center(
    api: Callable[..., APIClient], world: World
) -> None:
    admin = api("alice")
    admin.patch(f"/api/v1/projects/{world.project_a}/", {"cost_center": "CC-4711"}, format="json")
    prices = {"gpu_hour": {"H100": "7"}, "tokens_million": {"chat": {"in": "1", "out": "3"}}, "gb_month": "0"}
    admin.put("/api/v1/price-book/", prices, format="json")
    assert admin.post("/api/v1/usage/events/", {"events": EVENTS}, format="json").json()["accepted"] == 2

    response = admin.get("/api/v1/usage/chargeback/?period=2026-11&file=csv")
    assert response.status_code == 200
    assert response["Content-Disposition"] == 'attachment; filename="klique-acme-2026-11-chargeback.csv"'
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    gpu = next(row for row in rows if row["kind"] == "gpu")
    assert (gpu["cost_center"], gpu["project"], gpu["gpu_class"], gpu["gpu_hours"]) == (
        "CC-4711",
        "apollo",
        "H100",
        "0.285714",
    )
    assert Decimal(gpu["cost_usd"]) == Decimal("2.000000000")  # 2/7 GPU-hours at 7 USD
    call = next(row for row in rows if row["kind"] == "tokens" and row["tokens_in"] == "1000000")
    assert (call["project"], Decimal(call["cost_usd"])) == ("", Decimal("7.000000000"))

    parquet = admin.get("/api/v1/usage/chargeback/?period=2026-11&file=parquet")
    table = pq.read_table(io.BytesIO(parquet.content))
    assert table.schema.field("cost_usd").type.scale == 9  # exact decimals, not floats
    assert sum(table.column("cost_usd").to_pylist()) == sum(Decimal(row["cost_usd"]) for row in rows)

    assert admin.get("/api/v1/usage/chargeback/?period=November").status_code == 400
    assert api("bob").get("/api/v1/usage/chargeback/?period=2026-11").status_code == 403


def test_a_closed_period_takes_late_events_into_the_next(api: Callable[..., APIClient]) -> None:
    this_month = timezone.now().date().replace(day=1)
    last_month = (this_month - timedelta(days=1)).replace(day=1)
    admin = api("alice")
    closed = admin.post(f"/api/v1/usage/periods/{last_month:%Y-%m}/close/")
    assert closed.status_code == 200, closed.content
    assert admin.post(f"/api/v1/usage/periods/{last_month:%Y-%m}/close/").status_code == 400
    late = {**EVENTS[1], "event_id": "late-call", "started_at": f"{last_month:%Y-%m}-02T09:00:00+00:00"}
    admin.post("/api/v1/usage/events/", {"events": [late]}, format="json")
    (event,) = [
        e for e in admin.get("/api/v1/usage/?kind=tokens").json()["results"] if e["event_id"] == "late-call"
    ]
    assert (event["period"], event["late"]) == (this_month.isoformat(), True)
    current = admin.post(f"/api/v1/usage/periods/{this_month:%Y-%m}/close/")
    assert current.status_code == 400
    assert "has not ended yet" in current.json()["detail"]
