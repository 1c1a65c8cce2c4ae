"""PlainOut renders exactly what DRF's own serializer renders for the same fields, and refuses fields whose
output could depend on the serializer they are bound to."""

from __future__ import annotations

import uuid
import zoneinfo
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace
from typing import Any, cast

import pytest
from django.utils import timezone
from rest_framework import serializers

from apps.core.serializers import PlainOut


def declared() -> dict[str, Any]:
    """A fresh set of fields of every plain kind (a field may be declared on one class only)."""
    return {
        "id": serializers.UUIDField(read_only=True),
        "name": serializers.CharField(read_only=True),
        "email": serializers.EmailField(read_only=True),
        "site": serializers.URLField(read_only=True),
        "state": serializers.ChoiceField(choices=[("queued", "Queued"), ("running", "Run")], read_only=True),
        "count": serializers.IntegerField(read_only=True),
        "share": serializers.FloatField(read_only=True),
        "cost": serializers.DecimalField(max_digits=12, decimal_places=4, read_only=True),
        "ok": serializers.BooleanField(read_only=True),
        "at": serializers.DateTimeField(read_only=True),
        "day": serializers.DateField(read_only=True),
        "took": serializers.DurationField(read_only=True),
        "spec": serializers.JSONField(read_only=True),
        "owner": serializers.CharField(source="user.username", read_only=True),
        "maybe": serializers.CharField(read_only=True, default="-"),
    }


Plain = cast(type[PlainOut], type("Plain", (PlainOut,), declared()))
Drf = type("Drf", (serializers.Serializer,), declared())

ROWS = [
    SimpleNamespace(
        id=uuid.UUID(int=7),
        name="train-llama",
        email="a@acme.test",
        site="https://acme.test/x",
        state="running",
        count=3,
        share=0.25,
        cost=Decimal("12.34567"),
        ok=True,
        at=datetime(2026, 12, 4, 20, 0, tzinfo=UTC),
        day=date(2026, 12, 4),
        took=timedelta(hours=1, seconds=3),
        spec={"gpus": 2, "env": ["A", None], "nested": {"deep": [1.5]}},
        user=SimpleNamespace(username="alice"),
    ),
    SimpleNamespace(  # every value None, an unknown choice, another time zone, no `maybe` attribute
        id=None,
        name="",
        email=None,
        site=None,
        state="lost",
        count=0,
        share=None,
        cost=Decimal(0),
        ok=False,
        at=datetime(2026, 6, 1, 9, 30, tzinfo=zoneinfo.ZoneInfo("Asia/Tokyo")),
        day=None,
        took=None,
        spec=None,
        user=SimpleNamespace(username=None),
    ),
    {  # a dict, as DRF also reads
        "id": str(uuid.UUID(int=9)),
        "name": "ünïcødé ✓",
        "email": "b@acme.test",
        "site": "",
        "state": "queued",
        "count": -1,
        "share": 1e-9,
        "cost": Decimal("-0.00005"),
        "ok": 1,
        "at": "2026-12-04T20:00:00Z",  # a string is passed through, as DRF does
        "day": "2026-12-04",
        "took": timedelta(0),
        "spec": [],
        "user": {"username": "bob"},
        "maybe": "here",
    },
]


@pytest.mark.parametrize("row", ROWS, ids=["full", "nones", "dict"])
def test_one_object_renders_as_drf_renders_it(row: Any) -> None:
    assert Plain(row).data == Drf(row).data
    assert list(Plain(row).data) == list(Drf(row).data)  # the same keys, in the same order


def test_many_and_the_current_time_zone_render_as_drf_renders_them() -> None:
    assert Plain(ROWS, many=True).data == Drf(ROWS, many=True).data
    with timezone.override(zoneinfo.ZoneInfo("America/Sao_Paulo")):
        assert Plain(ROWS[0]).data["at"] == Drf(ROWS[0]).data["at"] == "2026-12-04T17:00:00-03:00"


def test_the_fields_are_bound_once_and_still_described_as_drf_s() -> None:
    assert Plain(ROWS[0]).data["name"] == "train-llama"
    bound = Plain._readable()
    assert Plain(ROWS[1]).data["name"] == ""
    assert Plain._readable() is bound
    assert list(Plain().fields) == list(Drf().fields)  # what the API schema is made from


@pytest.mark.parametrize(
    "field",
    [
        serializers.SerializerMethodField(),
        serializers.PrimaryKeyRelatedField(read_only=True),
        serializers.HiddenField(default="x"),
        serializers.ListField(child=serializers.CharField(), read_only=True),
        serializers.ReadOnlyField(),
        type("Shouting", (serializers.CharField,), {})(read_only=True),  # a subclass may read its context
    ],
    ids=["method", "related", "hidden", "list", "read-only", "subclass"],
)
def test_a_field_whose_output_may_depend_on_the_serializer_is_refused(field: Any) -> None:
    with pytest.raises(TypeError, match=r"Wrong\.odd is a"):
        type("Wrong", (PlainOut,), {"odd": field})


def test_a_nested_serializer_or_a_writable_field_is_refused() -> None:
    with pytest.raises(TypeError, match=r"Nested\.inner is a Drf"):
        type("Nested", (PlainOut,), {"inner": Drf(read_only=True)})
    with pytest.raises(TypeError, match=r"Writable\.name: PlainOut is for output"):
        type("Writable", (PlainOut,), {"name": serializers.CharField()})
