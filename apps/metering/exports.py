"""Chargeback files: a period's ledger summed per cost center, project, kind, pool, GPU class, model and
instance type, as CSV (for spreadsheets) or Parquet (for data warehouses, with exact decimal types). A
cloud pool's instance time is its own row (kind instance, or idle for the time its instances ran no
work), with no cost center or project: the pool's cost beside the GPU-hours charged to projects."""

from __future__ import annotations

import io
from collections.abc import Iterable
from datetime import date
from decimal import Decimal
from typing import Any

from django.db.models import Count

from apps.core.spreadsheet import csv_bytes
from apps.metering.ledger import amount_sums, gb_hours, gpu_hours, instance_hours, usd
from apps.metering.models import LedgerEvent

COLUMNS = (
    "period", "cost_center", "project", "kind", "pool", "gpu_class", "model", "instance_type", "events",
    "gpu_hours", "tokens_in", "tokens_out", "gb_hours", "instance_hours", "cost_usd",
)  # fmt: skip
SIX = Decimal("0.000001")


def chargeback(period: date) -> list[dict[str, Any]]:
    """The period's usage and cost per cost center and project (events that landed late in it included)."""
    rows: Iterable[Any] = (  # rows of .values(), with the sums annotated
        LedgerEvent.objects.filter(period=period)
        .values("cost_center", "project_name", "kind", "pool", "gpu_class", "model", "instance_type")
        .annotate(events=Count("event_id"), **amount_sums())
        .order_by("cost_center", "project_name", "kind", "pool", "gpu_class", "model", "instance_type")
    )
    return [
        {
            "period": f"{period:%Y-%m}",
            "cost_center": row["cost_center"],
            "project": row["project_name"],
            "kind": row["kind"],
            "pool": row["pool"],
            "gpu_class": row["gpu_class"],
            "model": row["model"],
            "instance_type": row["instance_type"],
            "events": row["events"],
            "gpu_hours": gpu_hours(row["gpu_unit_ms"]).quantize(SIX),
            "tokens_in": int(row["tokens_in"]),
            "tokens_out": int(row["tokens_out"]),
            "gb_hours": gb_hours(row["byte_ms"]).quantize(SIX),
            "instance_hours": instance_hours(row["instance_ms"]).quantize(SIX),
            "cost_usd": usd(row["cost"]).quantize(Decimal("0.000000001")),
        }
        for row in rows
    ]


def to_csv(rows: list[dict[str, Any]]) -> bytes:
    """For spreadsheets: names people chose are written so that no spreadsheet evaluates them."""
    return csv_bytes(COLUMNS, rows)


def to_parquet(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa  # noqa: PLC0415 -- 0.4 s to import; only Parquet exports use it
    import pyarrow.parquet as pq  # noqa: PLC0415 -- as above

    schema = pa.schema(
        [
            ("period", pa.string()),
            ("cost_center", pa.string()),
            ("project", pa.string()),
            ("kind", pa.string()),
            ("pool", pa.string()),
            ("gpu_class", pa.string()),
            ("model", pa.string()),
            ("instance_type", pa.string()),
            ("events", pa.int64()),
            ("gpu_hours", pa.decimal128(24, 6)),
            ("tokens_in", pa.int64()),
            ("tokens_out", pa.int64()),
            ("gb_hours", pa.decimal128(24, 6)),
            ("instance_hours", pa.decimal128(24, 6)),
            ("cost_usd", pa.decimal128(24, 9)),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()
