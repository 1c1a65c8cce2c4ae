"""The web's connection pool checks a connection it lends by a poll of its socket, and with a query only
where the socket has something to read (apps.core.postgresql): a healthy connection costs no round trip,
and one that PostgreSQL let go is still never lent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection
from psycopg_pool import ConnectionPool

from apps.core.postgresql import base as backend


def admin_url() -> str:
    settings = connection.settings_dict
    return f"postgresql://{settings['USER']}@{settings['HOST']}:{settings['PORT']}/{settings['NAME']}"


@pytest.fixture
def wrapper() -> Iterator[backend.DatabaseWrapper]:
    """Klique's backend with a pool of one connection, as the web process has (with more)."""
    settings = {
        **connection.settings_dict,
        "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": True,
        "OPTIONS": {"pool": {"min_size": 1, "max_size": 1, "timeout": 5}},
    }
    pooled = backend.DatabaseWrapper(settings, alias="pool-check")
    yield pooled
    pooled.close()
    pooled.close_pool()


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The checks that went to the server (pids of the connections they were made on)."""
    made: list[int] = []
    original = ConnectionPool.check_connection

    def counted(conn: psycopg.Connection[Any]) -> None:
        made.append(conn.info.backend_pid)
        original(conn)

    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(counted))
    return made


def backend_pid(pooled: backend.DatabaseWrapper) -> int:
    pooled.connect()
    with pooled.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    pooled.close()  # back to the pool
    return int(pid)


def until_gone(pid: int) -> None:
    """Wait until the backend of `pid` has ended (its farewell is then on its client's socket)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with psycopg.connect(admin_url(), autocommit=True) as other:
            gone = other.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
        if gone == (0,):
            return
        time.sleep(0.02)
    raise AssertionError(f"backend {pid} is still there")


def test_a_healthy_connection_is_lent_without_a_round_trip(
    wrapper: backend.DatabaseWrapper, round_trips: list[int], transactional_db: None
) -> None:
    first = backend_pid(wrapper)
    assert [backend_pid(wrapper) for _ in range(5)] == [first] * 5
    assert round_trips == []


@pytest.mark.parametrize("ending", ["pg_terminate_backend", "pg_cancel_backend_then_terminate"])
def test_a_connection_postgresql_let_go_is_replaced_before_it_is_lent(
    wrapper: backend.DatabaseWrapper, round_trips: list[int], transactional_db: None, ending: str
) -> None:
    first = backend_pid(wrapper)
    with psycopg.connect(admin_url(), autocommit=True) as other:
        if ending == "pg_cancel_backend_then_terminate":  # a cancel of an idle backend sends nothing
            other.execute("SELECT pg_cancel_backend(%s)", [first])
        other.execute("SELECT pg_terminate_backend(%s)", [first])
    until_gone(first)
    second = backend_pid(wrapper)  # would raise "terminating connection" on the broken one
    assert second != first
    assert round_trips == [first]  # the broken one was checked by query; the new one was not


def test_a_connection_with_a_stray_message_is_checked_and_kept(
    wrapper: backend.DatabaseWrapper, round_trips: list[int], transactional_db: None
) -> None:
    first = backend_pid(wrapper)
    wrapper.connect()
    with wrapper.cursor() as cursor:
        cursor.execute("LISTEN klique_pool_check")
    wrapper.close()
    with psycopg.connect(admin_url(), autocommit=True) as other:
        other.execute("NOTIFY klique_pool_check, 'hello'")
    time.sleep(0.2)  # the notification is on the pooled connection's socket
    assert backend_pid(wrapper) == first
    assert round_trips == [first]
    assert backend_pid(wrapper) == first
    assert round_trips == [first]  # read, so the next lending polls a quiet socket again


def test_a_closed_connection_is_never_lent(
    wrapper: backend.DatabaseWrapper, round_trips: list[int], transactional_db: None
) -> None:
    first = backend_pid(wrapper)
    pool = wrapper.pool
    assert pool is not None
    with pool.connection() as lent:
        lent.close()  # a connection closed while lent is discarded when given back
    assert backend_pid(wrapper) != first
    closed = psycopg.connect(admin_url())
    closed.close()
    with pytest.raises(psycopg.OperationalError):
        backend.check_unless_quiet(closed)
