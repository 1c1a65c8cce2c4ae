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
def _by_host_sql(*, entering: bool) -> str:
    public = connection.ops.quote_name(get_public_schema_name())
    # Entering: the search path django-tenants would set for the tenant found, set by the same statement
    # (a session setting, not a transaction's: the request's transaction has not begun yet).
    enter = (
        ", set_config('search_path', CASE WHEN t.schema_name = %s THEN %s "
        "ELSE quote_ident(t.schema_name) || %s END, false)"
        if entering
        else ""
    )
    return (
        f"SELECT {rows.columns(Tenant, 't')}{enter} FROM {public}.tenants_domain d "  # noqa: S608 -- names
        f"JOIN {public}.tenants_tenant t ON t.id = d.tenant_id WHERE d.domain = %s"
    )


def tenant_for_host(host: str) -> Tenant | None:
    """The tenant served at `host` (one query, compiled once, schema-qualified)."""
    with connection.cursor() as cursor:
        cursor.execute(_by_host_sql(entering=False), [host.lower()])
        row = cursor.fetchone()
    return rows.build(Tenant, row) if row is not None else None


def _quoted(schemas: list[str]) -> str:
    return ",".join(connection.ops.quote_name(schema) for schema in schemas)


def tenant_enter(host: str) -> Tenant | None:
    """The tenant served at `host`, with the connection's schema set to it; None, with the public schema
    selected, where no tenant is served there. Every request asks (tenants.middleware).

    One round trip: the query runs whatever the search path is (it is schema-qualified), and it sets the
    session's search path to the tenant's as it reads the tenant. The request's first query in that
    schema then needs no `SET search_path` of its own: with TENANT_LIMIT_SET_CALLS, django-tenants sets
    it only after a change of schema, and it is told here what this statement set.
    """
    public = get_public_schema_name()
    shared = [public, *getattr(settings, "PG_EXTRA_SEARCH_PATHS", [])]
    # The statement sets the search path itself, so the cursor must not issue a `SET` first (a pooled
    # connection comes with none recorded): record "public" for the moment, and forget it on any failure
    # below, since then the path is whatever the connection's last request left.
    connection.set_schema_to_public()  # type: ignore[attr-defined]  # django-tenants backend method
    connection.search_path_set_schemas = [public]  # type: ignore[attr-defined]
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                _by_host_sql(entering=True), [public, _quoted(shared), "," + _quoted(shared), host.lower()]
            )
            row = cursor.fetchone()
    except BaseException:
        connection.search_path_set_schemas = None  # type: ignore[attr-defined]
        raise
    if row is None:  # nothing was set: the next query sets the public schema's path
        connection.search_path_set_schemas = None  # type: ignore[attr-defined]
        return None
    tenant = rows.build(Tenant, row[:-1])
    connection.set_tenant(tenant)  # type: ignore[attr-defined]  # django-tenants backend method
    # What the statement set, in the form django-tenants keeps it; a rollback of the connection forgets it.
    connection.search_path_set_schemas = connection._get_cursor_search_paths()  # type: ignore[attr-defined]
    return tenant


def tenant_list() -> QuerySet[Tenant]:
    """Every customer tenant, without the provider's own public one."""
    return Tenant.objects.exclude(schema_name=get_public_schema_name()).prefetch_related("domains")


def tenant_get(*, slug: str) -> Tenant | None:
    return tenant_list().filter(slug=slug).first()


def tenant_address(tenant: Tenant) -> str:
    domain = tenant.get_primary_domain()
    return domain.domain if domain else f"{tenant.slug}.{settings.KLIQUE_BASE_DOMAIN}"
