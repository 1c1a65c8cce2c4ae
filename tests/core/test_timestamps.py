"""`timestamptz` values are loaded by psycopg's compiled loader where the session is in UTC
(apps.core.postgresql.UtcTimestamptzLoader), and are the very values Django's own loader gives."""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
from django.db import DataError, connection, transaction
from psycopg.pq import Format

from apps.core.postgresql.base import (
    COMPILED_TIMESTAMPTZ,
    TIMESTAMPTZ,
    DjangoUtcLoader,
    UtcTimestamptzLoader,
)
from tenants.models import Tenant

LITERALS = [
    "2026-12-05 07:17:58.724755+00",
    "2026-12-05 08:17:58.724755+01",  # another offset: the same instant
    "2024-02-29 23:59:59.999999-09:30",
    "2026-03-29 01:30:00+00",  # a daylight-saving change elsewhere
    "0001-01-01 00:00:00+00",
    "9999-12-31 23:59:59.999999+00",
    "1970-01-01 00:00:00+00",
    "2000-01-01 00:00:00.000001+14",
]


def loaded(sql: str, *, loader: type | None = None) -> list[object]:
    with connection.cursor() as cursor:
        if loader is not None:
            cursor.cursor.adapters.register_loader(TIMESTAMPTZ, loader)
        cursor.execute(sql)
        return [value for row in cursor.fetchall() for value in row]


def literals_sql(literals: list[str] = LITERALS) -> str:
    values = ", ".join(f"('{literal}'::timestamptz)" for literal in literals)
    return f"SELECT v FROM (VALUES {values}, (NULL::timestamptz)) AS t(v)"  # noqa: S608 -- the constants above


def test_the_connection_loads_timestamps_with_the_compiled_loader(db: None) -> None:
    with connection.cursor() as cursor:
        registered = cursor.cursor.adapters.get_loader(TIMESTAMPTZ, Format.TEXT)
        assert registered is UtcTimestamptzLoader
        instance = UtcTimestamptzLoader(TIMESTAMPTZ, cursor.cursor)
        assert type(instance.load.__self__) is COMPILED_TIMESTAMPTZ  # type: ignore[attr-defined]


def test_values_are_django_s_own(db: None) -> None:
    ours = loaded(literals_sql())
    django = loaded(literals_sql(), loader=DjangoUtcLoader)
    assert ours == django
    assert [value.tzinfo for value in ours if value is not None] == [datetime.UTC] * len(LITERALS)  # type: ignore[attr-defined]
    assert [value.isoformat() for value in ours if value is not None] == [  # type: ignore[attr-defined]
        value.isoformat()  # type: ignore[attr-defined]
        for value in django
        if value is not None
    ]
    assert ours[-1] is None
    assert ours[0] == datetime.datetime(2026, 12, 5, 7, 17, 58, 724755, tzinfo=datetime.UTC)
    assert ours[1] == ours[0]


@pytest.mark.parametrize("literal", ["infinity", "-infinity"])
def test_values_python_cannot_hold_are_refused_as_by_django(db: None, literal: str) -> None:
    for loader in (None, DjangoUtcLoader):
        with pytest.raises(DataError), transaction.atomic():
            loaded(f"SELECT '{literal}'::timestamptz", loader=loader)


@pytest.fixture
def session_in_paris(db: None) -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'Europe/Paris'")
    yield
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'UTC'")


def test_a_session_moved_out_of_utc_gets_django_s_loader(session_in_paris: None) -> None:
    with connection.cursor() as cursor:
        instance = UtcTimestamptzLoader(TIMESTAMPTZ, cursor.cursor)
        assert type(instance.load.__self__) is DjangoUtcLoader  # type: ignore[attr-defined]
    # (Django's loader gives the session's wall time marked as UTC there; so does this one, as Django. The
    # last second of year 9999 in UTC is in year 10000 in Paris: neither can load it.)
    within = literals_sql([literal for literal in LITERALS if not literal.startswith("9999")])
    assert loaded(within) == loaded(within, loader=DjangoUtcLoader)


def test_models_read_back_what_they_saved(world: object, db: None) -> None:
    moment = datetime.datetime(2026, 12, 5, 7, 17, 58, 724755, tzinfo=datetime.UTC)
    tenant = Tenant.objects.exclude(schema_name="public").first()
    assert tenant is not None
    Tenant.objects.filter(pk=tenant.pk).update(suspended_at=moment)
    read = Tenant.objects.get(pk=tenant.pk).suspended_at
    assert read == moment
    assert read is not None
    assert read.tzinfo is datetime.UTC
