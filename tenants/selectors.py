"""Reads of the public schema: tenants by host or slug, and their addresses."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

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
    selected, where no tenant is served there."""
    return tenant_enter_reading(host)[0]


def tenant_enter_reading(
    host: str, then: str | None = None, params: Sequence[Any] = ()
) -> tuple[Tenant | None, tuple[Any, ...] | None]:
    """The tenant served at `host`, with the connection's schema set to it, and the first row of `then`
    read in that schema in the same round trip (None where `then` is None, finds nothing, or no tenant
    is served at `host`). Every request asks (tenants.middleware).

    One round trip: the first statement runs whatever the search path is (it is schema-qualified), and it
    sets the session's search path to the tenant's as it reads the tenant. The request's first query in
    that schema then needs no `SET search_path` of its own: with TENANT_LIMIT_SET_CALLS, django-tenants
    sets it only after a change of schema, and it is told here what this statement set.

    `then` (unqualified names, `%s` parameters) is sent in the same message, so PostgreSQL resolves its
    names under the path the first statement has just set. It reads nothing unless the schema it sees
    is that of the tenant of `host` (a guard appended to its WHERE), so an unknown host, which sets no
    path, never reads another tenant's rows from a path a pooled connection kept.
    """
    public = get_public_schema_name()
    # The statement sets the search path itself, so the cursor must not issue a `SET` first (a pooled
    # connection comes with none recorded): record "public" for the moment, and forget it on any failure
    # below, since then the path is whatever the connection's last request left.
    connection.set_schema_to_public()  # type: ignore[attr-defined]  # django-tenants backend method
    connection.search_path_set_schemas = [public]  # type: ignore[attr-defined]
    sql, arguments = entering_statement(host, then, params)
    read = None
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, arguments)
            row = cursor.fetchone()
            if then is not None and cursor.nextset():
                read = cursor.fetchone()
    except BaseException:
        connection.search_path_set_schemas = None  # type: ignore[attr-defined]
        raise
    if row is None:  # nothing was set: the next query sets the public schema's path
        connection.search_path_set_schemas = None  # type: ignore[attr-defined]
        return None, None
    tenant = rows.build(Tenant, row[:-1])
    connection.set_tenant(tenant)  # type: ignore[attr-defined]  # django-tenants backend method
    # What the statement set, in the form django-tenants keeps it; a rollback of the connection forgets it.
    connection.search_path_set_schemas = connection._get_cursor_search_paths()  # type: ignore[attr-defined]
    return tenant, read


def entering_statement(host: str, then: str | None, params: Sequence[Any]) -> tuple[str, list[Any]]:
    """The message tenant_enter_reading sends: the tenant's lookup that sets the search path, then `then`
    guarded to read only where the schema it sees is that of the tenant of `host`."""
    public = get_public_schema_name()
    shared = [public, *getattr(settings, "PG_EXTRA_SEARCH_PATHS", [])]
    sql = _by_host_sql(entering=True)
    arguments: list[Any] = [public, _quoted(shared), "," + _quoted(shared), host.lower()]
    if then is not None:
        sql = f"{sql}; {then} AND current_schema() = ({_schema_of_host_sql()})"
        arguments += [*params, host.lower()]
    return sql, arguments


@functools.cache
def _schema_of_host_sql() -> str:
    public = connection.ops.quote_name(get_public_schema_name())
    return (
        f"SELECT t.schema_name FROM {public}.tenants_domain d "  # noqa: S608 -- names only
        f"JOIN {public}.tenants_tenant t ON t.id = d.tenant_id WHERE d.domain = %s"
    )


def tenant_list() -> QuerySet[Tenant]:
    """Every customer tenant, without the provider's own public one."""
    return Tenant.objects.exclude(schema_name=get_public_schema_name()).prefetch_related("domains")


def tenant_get(*, slug: str) -> Tenant | None:
    return tenant_list().filter(slug=slug).first()


def tenant_address(tenant: Tenant) -> str:
    domain = tenant.get_primary_domain()
    return domain.domain if domain else f"{tenant.slug}.{settings.KLIQUE_BASE_DOMAIN}"
