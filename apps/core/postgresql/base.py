"""Django's PostgreSQL backend, with a pool that checks a connection it lends without a round trip, and
cursors whose statements PostgreSQL keeps planned.

The web process lends each request a connection from a psycopg pool. Django's pool checks each one as it
leaves the pool with an empty query (`ConnectionPool.check_connection`): a round trip per request, about
as long as the whole of `/healthz`, to find connections that a restart of PostgreSQL broke.

A connection that PostgreSQL has let go has something to read: the server's farewell (a FATAL
"terminating connection") and the end of the stream, or the end of the stream alone where the backend
was killed. A healthy idle connection has nothing to read. So the check first polls the socket without
waiting; only a connection with something to read gets the empty query, which raises where the
connection is broken (the pool then discards it and lends another) and reads any stray notice where it
is not. A peer that vanished without closing (a cut network) is not found this way, nor by the empty
query, which would wait for the same TCP timeout.

Django loads every `timestamptz` with a loader of its own written in Python (psycopg's, then the time
zone set): about 6 µs a value here, against about 1 µs for psycopg's compiled one, on rows that carry many
(a task has eight). Where the connection is in UTC, as Django keeps it when USE_TZ is on, both give the
same aware datetime, so `UtcTimestamptzLoader` gives Django's answer with the compiled loader.

Django binds parameters in the client and sends each statement to be parsed and planned anew (what lets
one message carry several statements, as apps.core.deferred needs). For the few statements that run on
every request and cost more to plan than to run, `prepared_cursor` gives a cursor that prepares them
instead (see there).
"""

from __future__ import annotations

import datetime
import select
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db.backends.base.base import NO_DB_ALIAS
from django.db.backends.postgresql import base as postgresql
from django.db.backends.postgresql.operations import DatabaseOperations as PostgresOperations
from django.db.backends.postgresql.psycopg_any import BaseTzLoader
from django.db.backends.utils import CursorWrapper
from psycopg import Connection, OperationalError, postgres
from psycopg.abc import AdaptContext
from psycopg.adapt import Loader
from psycopg.pq import Format
from psycopg_pool import ConnectionPool

TIMESTAMPTZ = postgres.types["timestamptz"].oid
COMPILED_TIMESTAMPTZ = postgres.adapters.get_loader(TIMESTAMPTZ, Format.TEXT)  # C where psycopg has it


def check_unless_quiet(connection: Connection[Any]) -> None:
    """The pool's check: raise where `connection` is broken; a round trip only where its socket has
    something to read."""
    if connection.closed or connection.broken:
        raise OperationalError("the connection is closed")
    poll = select.poll()
    poll.register(connection.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    if poll.poll(0):
        ConnectionPool.check_connection(connection)


class DjangoUtcLoader(BaseTzLoader):
    timezone = datetime.UTC


class UtcTimestamptzLoader(Loader):
    """Django's `timestamptz` loader for a connection in UTC (an aware datetime in `datetime.UTC`), by
    psycopg's compiled loader where the session's time zone is UTC, as Django sets it; by Django's own
    where it is not (a session whose time zone was changed after it connected)."""

    timezone = datetime.UTC  # what Django's create_cursor compares with the connection's time zone

    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        connection = context.connection if context is not None else None
        in_utc = connection is not None and connection.info.timezone is datetime.UTC
        loader = (COMPILED_TIMESTAMPTZ or DjangoUtcLoader) if in_utc else DjangoUtcLoader
        self.load = loader(oid, context).load  # type: ignore[method-assign]  # the chosen loader's, as is

    def load(self, data: Any) -> Any:  # replaced on each instance
        raise NotImplementedError


class DatabaseOperations(PostgresOperations):
    def last_executed_query(self, cursor: Any, sql: str, params: Any) -> str:
        """As Django's, and for a `prepared_cursor`'s statement (bound by the server, so psycopg keeps no
        text with the values in it) the same text Django would show for it."""
        if type(cursor) is psycopg.Cursor:
            return psycopg.ClientCursor(cursor.connection).mogrify(sql, params)
        return super().last_executed_query(cursor, sql, params)


class DatabaseWrapper(postgresql.DatabaseWrapper):
    ops_class = DatabaseOperations

    def get_connection_params(self) -> dict[str, Any]:
        """Django's, with `UtcTimestamptzLoader` where Django's connections are in UTC (USE_TZ)."""
        params: dict[str, Any] = super().get_connection_params()
        if self.timezone is datetime.UTC:
            params["context"].register_loader(TIMESTAMPTZ, UtcTimestamptzLoader)
        return params

    @property
    def pool(self) -> ConnectionPool[Any] | None:
        """Django's pool (its options, its opening on first use), checked by `check_unless_quiet` where
        CONN_HEALTH_CHECKS asks for checks."""
        options = self.settings_dict["OPTIONS"].get("pool")
        if self.alias == NO_DB_ALIAS or not options:
            return None
        pools: dict[str, ConnectionPool[Any]] = self._connection_pools  # type: ignore[attr-defined]
        if self.alias not in pools:
            if self.settings_dict.get("CONN_MAX_AGE", 0) != 0:
                return super().pool  # type: ignore[no-any-return]  # Django refuses this, saying why
            arguments = self.get_connection_params()
            arguments["autocommit"] = True  # Django sets what it wants once it has the connection
            pool: ConnectionPool[Any] = ConnectionPool(
                kwargs=arguments,
                open=False,  # opened on first use, as Django's
                configure=self._configure_connection,  # type: ignore[attr-defined]
                check=check_unless_quiet if self.settings_dict["CONN_HEALTH_CHECKS"] else None,
                **({} if options is True else options),
            )
            # setdefault: of two threads making the pool at once, the first one's is kept (as in Django).
            pools.setdefault(self.alias, pool)
        return pools[self.alias]

    @contextmanager
    def prepared_cursor(self) -> Iterator[CursorWrapper]:
        """A cursor whose statements are prepared: each text is parsed and planned once per connection (at
        its first execution) and then only run, with its parameters bound by the server. One statement per
        execute; psycopg keeps the last 100 texts prepared per connection and deallocates older ones.

        It is Django's cursor otherwise (its query log, its errors, its execute wrappers), and it does not
        set the search path first as django-tenants' cursors do: the statements it is for name their
        schemas. PostgreSQL plans such a statement again only where a table it names has changed, or where
        the search path differs from the one it was planned under.

        Django disables preparing on its connections (`prepare_threshold` None, for poolers that cannot
        keep prepared statements across transactions); it is enabled here for this cursor only. Behind
        PgBouncer in transaction mode that needs its `max_prepared_statements` (1.21 and later); where a
        pooler cannot keep them, `PREPARED_STATEMENTS` False in the settings (KLIQUE_DB_PREPARED_STATEMENTS=0)
        makes this Django's own cursor."""
        if not self.settings_dict.get("PREPARED_STATEMENTS", True):
            with self.cursor() as plain:
                yield plain
            return
        self.validate_thread_sharing()
        self.ensure_connection()
        raw: psycopg.Connection[Any] = self.connection
        threshold = raw.prepare_threshold
        with self.wrap_database_errors:
            cursor = psycopg.Cursor(raw)
        raw.prepare_threshold = 0  # prepare at the first execution: only server-side cursors prepare
        try:
            wrap = self.make_debug_cursor if self.queries_logged else self.make_cursor
            yield wrap(cursor)  # type: ignore[arg-type]  # (django-stubs: it wraps a DB-API cursor)
        finally:
            raw.prepare_threshold = threshold
            cursor.close()
