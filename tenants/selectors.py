"""Reads of the public schema: tenants by host or slug, and their addresses."""

from __future__ import annotations

import functools

from django.conf import settings
from django.db import connection
from django.db.models import QuerySet
from django_tenants.utils import get_public_schema_name

from apps.core import rows
from tenants.models import Tenant


@functools.cache
def _by_host_sql() -> str:
    public = connection.ops.quote_name(get_public_schema_name())
    return (
        f"SELECT {rows.columns(Tenant, 't')} FROM {public}.tenants_domain d "  # noqa: S608 -- names, not values
        f"JOIN {public}.tenants_tenant t ON t.id = d.tenant_id WHERE d.domain = %s"
    )


def tenant_for_host(host: str) -> Tenant | None:
    """The tenant served at `host` (every request asks: one query, compiled once, schema-qualified)."""
    with connection.cursor() as cursor:
        cursor.execute(_by_host_sql(), [host.lower()])
        row = cursor.fetchone()
    return rows.build(Tenant, row) if row is not None else None


def tenant_list() -> QuerySet[Tenant]:
    """Every customer tenant, without the provider's own public one."""
    return Tenant.objects.exclude(schema_name=get_public_schema_name()).prefetch_related("domains")


def tenant_get(*, slug: str) -> Tenant | None:
    return tenant_list().filter(slug=slug).first()


def tenant_address(tenant: Tenant) -> str:
    domain = tenant.get_primary_domain()
    return domain.domain if domain else f"{tenant.slug}.{settings.KLIQUE_BASE_DOMAIN}"
