"""Reads of the public schema: tenants by host or slug, and their addresses."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from django.conf import settings
from django.db import NotSupportedError, ProgrammingError, connection, transaction
from django.db.models import QuerySet
from django_tenants.utils import get_public_schema_name

from apps.core import rows
from tenants.models import Tenant


@functools.cache
def _domains_sql() -> str:
    """`FROM` the public schema's domains (`d`) joined to their tenants (`t`), schema-qualified."""
    public = connection.ops.quote_name(get_public_schema_name())
    return f"FROM {public}.tenants_domain d JOIN {public}.tenants_tenant t ON t.id = d.tenant_id"


@functools.cache
def _by_host_sql(*, entering: bool) -> str:
    # Entering: the search path django-tenants would set for the tenant found, set by the same statement
    # (a session setting, not a transaction's: the request's transaction has not begun yet).
    enter = (
        ", set_config('search_path', CASE WHEN t.schema_name = %s THEN %s "
        "ELSE quote_ident(t.schema_name) || %s END, false)"
        if entering
        else ""
    )
    return f"SELECT {rows.columns(Tenant, 't')}{enter} {_domains_sql()} WHERE d.domain = %s"


def tenant_for_host(host: str) -> Tenant | None:
    """The tenant served at `host` (one query, compiled once, schema-qualified)."""
    with connection.cursor() as cursor:
        cursor.execute(_by_host_sql(entering=False), [host.lower()])
        row = cursor.fetchone()
    return rows.build(Tenant, row) if row is not None else None


def _identifier(name: str) -> str:
    """`name` as a quoted SQL identifier, whatever it holds (Django's quote_name does not double quotes)."""
    return '"' + name.replace('"', '""') + '"'


def _quoted(schemas: list[str]) -> str:
    return ",".join(_identifier(schema) for schema in schemas)


def tenant_enter(host: str) -> Tenant | None:
    """The tenant served at `host`, with the connection's schema set to it; None, with the public schema
    selected, where no tenant is served there."""
    return tenant_enter_reading(host)[0]


# A read made in the round trip that finds the tenant: its SQL (`%s` parameters, ending in its WHERE clause)
# given the schema whose tables it names in full (quoted), or given None for unqualified names.
Read = Callable[[str | None], str]

# The schema of the tenant last found at each host: a guess that lets a request's one statement name that
# tenant's tables. Each use is checked by the same statement (the host's tenant must have that schema, or
# nothing is read), so a stale guess costs a second round trip, never another tenant's row.
_schema_at_host: dict[str, str] = {}
HOSTS_REMEMBERED = 10_000


def tenant_enter_reading(
    host: str, then: Read | None = None, params: Sequence[Any] = ()
) -> tuple[Tenant | None, tuple[Any, ...] | None]:
    """The tenant served at `host`, with the connection's schema set to it, and the first row of `then`
    read in that schema in the same round trip (None where `then` is None, finds nothing, or no tenant
    is served at `host`). Every request asks (tenants.middleware).

    One round trip, one statement, where the host's schema is known from an earlier request (nearly
    always): the statement finds the tenant by host, checks that its schema is the one remembered, sets
    the session's search path to it, and reads `then` from that schema's tables, named in full. Otherwise
    (a host not seen yet, or whose tenant changed) the lookup statement below, then that one's schema is
    remembered. Either way the request's first query in that schema needs no `SET search_path` of its
    own: with TENANT_LIMIT_SET_CALLS, django-tenants sets it only after a change of schema, and it is
    told here what the statement set.
    """
    host = host.lower()
    # The statement sets the search path itself, so the cursor must not issue a `SET` first (a pooled
    # connection comes with none recorded): record "public" for the moment, and forget it on any failure
    # below, since then the path is whatever the connection's last request left.
    connection.set_schema_to_public()  # type: ignore[attr-defined]  # django-tenants backend method
    connection.search_path_set_schemas = [get_public_schema_name()]  # type: ignore[attr-defined]
    try:
        schema = _schema_at_host.get(host)
        found = _enter_known(host, schema, then, params) if schema is not None else None
        if found is None:
            found = _enter_looking_up(host, then, params)
    except BaseException:
        connection.search_path_set_schemas = None  # type: ignore[attr-defined]
        raise
    tenant, read = found
    if tenant is None:  # nothing was set: the next query sets the public schema's path
        connection.search_path_set_schemas = None  # type: ignore[attr-defined]
        return None, None
    if tenant.schema_name != get_public_schema_name():
        if len(_schema_at_host) >= HOSTS_REMEMBERED:
            _schema_at_host.clear()
        _schema_at_host[host] = tenant.schema_name
    connection.set_tenant(tenant)  # type: ignore[attr-defined]  # django-tenants backend method
    # What the statement set, in the form django-tenants keeps it; a rollback of the connection forgets it.
    connection.search_path_set_schemas = connection._get_cursor_search_paths()  # type: ignore[attr-defined]
    return tenant, read


Found = tuple[Tenant | None, tuple[Any, ...] | None]


def _enter_known(host: str, schema: str, then: Read | None, params: Sequence[Any]) -> Found | None:
    """The tenant at `host` and `then`'s row, where that tenant's schema is still `schema`; None where
    it is not (or the schema is gone), with nothing read and the guess forgotten.

    The statement is prepared (apps.core.postgresql): planning it costs PostgreSQL several times what
    running it does, on every request."""
    sql, arguments = known_schema_statement(host, schema, then, params)
    try:
        # A schema dropped since it was remembered makes the statement fail; outside a transaction (as
        # the middleware runs) nothing else is lost, inside one a savepoint keeps the rest.
        with (
            transaction.atomic() if connection.in_atomic_block else contextlib.nullcontext(),
            connection.prepared_cursor() as cursor,  # type: ignore[attr-defined]  # apps.core.postgresql
        ):
            cursor.execute(sql, arguments)
            row = cursor.fetchone()
    except (ProgrammingError, NotSupportedError):
        # The statement names tables that are gone or changed (a lost connection is not caught: the
        # lookup would meet it too). PostgreSQL may keep failing a prepared statement whose tables changed
        # shape: the next ones are texts of their own, prepared anew.
        _Texts.generation += 1
        _known_schema_sql.cache_clear()
        row = None
    if row is None:
        _schema_at_host.pop(host, None)
        return None
    width = rows.width(Tenant)
    tenant = rows.build(Tenant, row[:width])
    read = tuple(row[width + 2 :]) if then is not None and row[width + 1] else None
    return tenant, read


class _Texts:
    """Which texts of the prepared statements are current (a comment in each)."""

    generation = 0


def known_schema_statement(
    host: str, schema: str, then: Read | None, params: Sequence[Any]
) -> tuple[str, list[Any]]:
    """The one statement of a host whose tenant's schema is taken to be `schema`: the tenant, the search
    path set, and `then` read from `schema`'s tables (a `found` flag, then its columns, all NULL where it
    finds nothing). No row at all where the host's tenant has another schema or there is none."""
    sql, path = _known_schema_sql(schema, then)
    return sql, [path, *params, host, schema] if then is not None else [path, host, schema]


@functools.lru_cache(maxsize=1024)
def _known_schema_sql(schema: str, then: Read | None) -> tuple[str, str]:
    """known_schema_statement's text for `schema` and `then`, and the search path it sets."""
    path = _quoted([schema, get_public_schema_name(), *getattr(settings, "PG_EXTRA_SEARCH_PATHS", [])])
    select = f"SELECT {rows.columns(Tenant, 't')}, set_config('search_path', %s, false)"
    lookup = _domains_sql()
    where = "WHERE d.domain = %s AND t.schema_name = %s"
    if then is None:
        return f"/* {_Texts.generation} */ {select} {lookup} {where}", path
    read = then(_identifier(schema))
    sql = (
        f"/* {_Texts.generation} */ {select}, r.* {lookup} "  # noqa: S608 -- names only
        f"LEFT JOIN LATERAL (SELECT true AS found, q.* FROM ({read}) q LIMIT 1) r ON true {where}"
    )
    return sql, path


def _enter_looking_up(host: str, then: Read | None, params: Sequence[Any]) -> Found:
    """The tenant at `host` looked up, the search path set to its schema, and `then` read under that path,
    in one message of two statements (`entering_statement`)."""
    sql, arguments = entering_statement(host, then, params)
    read = None
    with connection.cursor() as cursor:
        cursor.execute(sql, arguments)
        row = cursor.fetchone()
        if then is not None and cursor.nextset():
            read = cursor.fetchone()
    if row is None:
        return None, None
    return rows.build(Tenant, row[:-1]), read


def entering_statement(host: str, then: Read | None, params: Sequence[Any]) -> tuple[str, list[Any]]:
    """The message that looks a host up: the tenant's lookup that sets the search path, then `then`
    (unqualified names) guarded to read only where the schema it sees is that of the tenant of `host`.

    `then` is sent in the same message, so PostgreSQL resolves its names under the path the first
    statement has just set. It reads nothing unless the schema it sees is that of the tenant of `host`
    (a guard appended to its WHERE), so an unknown host, which sets no path, never reads another
    tenant's rows from a path a pooled connection kept."""
    public = get_public_schema_name()
    shared = [public, *getattr(settings, "PG_EXTRA_SEARCH_PATHS", [])]
    sql = _by_host_sql(entering=True)
    arguments: list[Any] = [public, _quoted(shared), "," + _quoted(shared), host.lower()]
    if then is not None:
        sql = f"{sql}; {then(None)} AND current_schema() = ({_schema_of_host_sql()})"
        arguments += [*params, host.lower()]
    return sql, arguments


@functools.cache
def _schema_of_host_sql() -> str:
    return f"SELECT t.schema_name {_domains_sql()} WHERE d.domain = %s"


def tenant_list() -> QuerySet[Tenant]:
    """Every customer tenant, without the provider's own public one."""
    return Tenant.objects.exclude(schema_name=get_public_schema_name()).prefetch_related("domains")


def tenant_get(*, slug: str) -> Tenant | None:
    return tenant_list().filter(slug=slug).first()


def tenant_address(tenant: Tenant) -> str:
    domain = tenant.get_primary_domain()
    return domain.domain if domain else f"{tenant.slug}.{settings.KLIQUE_BASE_DOMAIN}"
