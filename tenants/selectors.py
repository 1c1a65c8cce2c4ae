"""Reads of the public schema: tenants by host or slug, and their addresses."""

from __future__ import annotations

from django.conf import settings
from django.db.models import QuerySet
from django_tenants.utils import get_public_schema_name, schema_context

from tenants.models import Domain, Tenant


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
