"""The provider's reads: each tenant's usage and cost, from the public schema's totals."""

from __future__ import annotations

from datetime import date
from typing import Any

from django.db.models import Sum

from apps.metering.ledger import amount_sums
from apps.metering.selectors import gpu_hours_text, usd_text
from tenants.models import TenantUsageDay


def usage_by_tenant(
    *, since: date | None = None, until: date | None = None, by_day: bool = False
) -> list[dict[str, Any]]:
    """Each tenant's metered usage and cost (per day too, with `by_day`), from the public schema's totals."""

    rows = TenantUsageDay.objects.all()
    if since:
        rows = rows.filter(day__gte=since)
    if until:
        rows = rows.filter(day__lt=until)
    keys = ["tenant__slug", "kind", *(["day"] if by_day else [])]
    totals = rows.values(*keys).annotate(events=Sum("events"), **amount_sums())
    return [
        {
            "tenant": row["tenant__slug"],
            "kind": row["kind"],
            **({"day": row["day"].isoformat()} if by_day else {}),
            "events": int(row["events"]),
            "gpu_hours": gpu_hours_text(row["gpu_unit_ms"]),
            "tokens_in": int(row["tokens_in"]),
            "tokens_out": int(row["tokens_out"]),
            "cost_usd": usd_text(row["cost"]),
        }
        for row in totals.order_by(*keys)
    ]
