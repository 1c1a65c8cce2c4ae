"""The gateway's usage writer reaches the database Django is configured with, however it is named: the
embedded PostgreSQL of `klique up` is a socket folder in the URL's ?host=, which Django keeps in OPTIONS."""

from __future__ import annotations

from typing import Any

import dj_database_url
import pytest
from psycopg.conninfo import conninfo_to_dict

from gateway import cache


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://postgres@/klique?host=/srv/klique/postgres", {"host": "/srv/klique/postgres"}),
        ("postgres://klique:pw@db.internal:6543/klique", {"host": "db.internal", "port": "6543"}),
        (
            "postgres://klique@db.internal/klique?sslmode=require",
            {"host": "db.internal", "sslmode": "require"},
        ),
    ],
)
def test_the_conninfo_names_the_configured_server(
    url: str, expected: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Connections:
        def __getitem__(self, name: str) -> Any:
            class Default:
                settings_dict = dj_database_url.parse(url)

            return Default()

    monkeypatch.setattr(cache, "connections", Connections())
    parsed = conninfo_to_dict(cache.database_conninfo())
    assert {key: parsed.get(key) for key in expected} == expected
    assert parsed["dbname"] == "klique"
