"""Django's PostgreSQL backend, with a pool that checks a connection it lends without a round trip.

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
"""

from __future__ import annotations

import select
from typing import Any

from django.db.backends.base.base import NO_DB_ALIAS
from django.db.backends.postgresql import base as postgresql
from psycopg import Connection, OperationalError
from psycopg_pool import ConnectionPool


def check_unless_quiet(connection: Connection[Any]) -> None:
    """The pool's check: raise where `connection` is broken; a round trip only where its socket has
    something to read."""
    if connection.closed or connection.broken:
        raise OperationalError("the connection is closed")
    poll = select.poll()
    poll.register(connection.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    if poll.poll(0):
        ConnectionPool.check_connection(connection)


class DatabaseWrapper(postgresql.DatabaseWrapper):
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
