"""`connection.prepared_cursor()` (apps.core.postgresql): statements that PostgreSQL plans once per
connection, while every other cursor of the connection still binds in the client, as Django's do."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, ProgrammingError, connection, transaction
from django.test.utils import CaptureQueriesContext

QUERY = "SELECT %s::int + 1, %s::text /* klique prepared test */"


def prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def test_a_statement_is_prepared_once_and_then_run(db: None) -> None:
    for value in (1, 2, 3):
        with connection.prepared_cursor() as cursor:  # type: ignore[attr-defined]
            cursor.execute(QUERY, [value, "x"])
            assert cursor.fetchone() == (value + 1, "x")
    texts = [text for text in prepared() if "klique prepared test" in text]
    assert len(texts) == 1
    assert "$1" in texts[0]  # parameters bound by the server


def test_other_cursors_are_not_prepared(db: None) -> None:
    with connection.prepared_cursor() as cursor:  # type: ignore[attr-defined]
        cursor.execute(QUERY, [1, "x"])
    assert connection.connection.prepare_threshold is None  # Django's setting, given back
    for value in range(8):  # more than psycopg's default threshold
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s::int /* klique client-side */", [value])
    assert not [text for text in prepared() if "klique client-side" in text]


def test_the_query_log_shows_the_statement_with_its_values(db: None) -> None:
    with (
        CaptureQueriesContext(connection) as queries,
        connection.prepared_cursor() as cursor,  # type: ignore[attr-defined]
    ):
        cursor.execute(QUERY, [41, "it's"])
    [query] = queries.captured_queries
    assert query["sql"] == "SELECT 41::int + 1, 'it''s'::text /* klique prepared test */"


@pytest.mark.parametrize(
    ("sql", "params"),
    [
        ("SELECT * FROM no_such_table_here", []),
        ("SELECT %s::int", ["not a number"]),
        ("SELECT 1; SELECT 2", []),  # one statement per execute
    ],
)
def test_errors_are_django_s_and_the_connection_goes_on(db: None, sql: str, params: list[object]) -> None:
    with (
        pytest.raises(DatabaseError),
        transaction.atomic(),
        connection.prepared_cursor() as cursor,  # type: ignore[attr-defined]
    ):
        cursor.execute(sql, params)
    assert connection.connection.prepare_threshold is None
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


def test_an_unknown_table_is_a_programming_error(db: None) -> None:
    with (
        pytest.raises(ProgrammingError, match="no_such_table"),
        transaction.atomic(),
        connection.prepared_cursor() as cursor,  # type: ignore[attr-defined]
    ):
        cursor.execute("SELECT * FROM no_such_table", [])


def test_prepared_statements_can_be_switched_off(db: None) -> None:
    # Behind a pooler that cannot keep them: the cursor is Django's own, binding in the client.
    settings = connection.settings_dict
    settings["PREPARED_STATEMENTS"] = False
    try:
        with connection.prepared_cursor() as cursor:  # type: ignore[attr-defined]
            cursor.execute("SELECT %s::int /* klique switched off */", [7])
            assert cursor.fetchone() == (7,)
    finally:
        settings["PREPARED_STATEMENTS"] = True
    assert not [text for text in prepared() if "klique switched off" in text]
