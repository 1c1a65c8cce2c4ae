"""Reads of the public schema: tenants by host or slug, and where a token lives."""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import QuerySet, Sum
from django_tenants.utils import get_public_schema_name, schema_context

from apps.metering.ledger import amount_sums, gpu_hours, usd
from tenants.models import Domain, Tenant, TenantUsageDay


def tenant_for_host(host: str) -> Tenant | None:
    with schema_context(get_public_schema_name()):
        domain = Domain.objects.select_related("tenant").filter(domain=host.lower()).first()
        return domain.tenant if domain else None


def tenant_list() -> QuerySet[Tenant]:
    """Every customer tenant, without the provider's own public one."""
    return Tenant.objects.exclude(schema_name=get_public_schema_name()).prefetch_related("domains")


def tenant_get(*, slug: str) -> Tenant | None:
    return tenant_list().filter(slug=slug).first()


def tenant_address(tenant: Tenant) -> str:
    domain = tenant.get_primary_domain()
    return domain.domain if domain else f"{tenant.slug}.{settings.KLIQUE_BASE_DOMAIN}"


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
            "gpu_hours": str(gpu_hours(row["gpu_unit_ms"]).quantize(Decimal("0.000001"))),
            "tokens_in": int(row["tokens_in"]),
            "tokens_out": int(row["tokens_out"]),
            "cost_usd": str(usd(row["cost"]).quantize(Decimal("0.000001"))),
        }
        for row in totals.order_by(*keys)
    ]
