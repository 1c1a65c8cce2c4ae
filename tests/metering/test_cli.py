"""`klique usage`, as a person reads it."""

from __future__ import annotations

import pytest

from klique.cli import parse_args
from klique.commands import run
from klique.sdk import Client
from tests.django_transport import DjangoTransport
from tests.world import World

pytestmark = pytest.mark.django_db


def usage(world: World, persona: str, *argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    client = Client("http://acme.klique.test", world.tokens[persona], transport=DjangoTransport())
    assert run(parse_args(["usage", *argv]), client) == 0
    return capsys.readouterr().out


def test_usage_by_project_and_by_user_with_a_total(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    admin = Client("http://acme.klique.test", world.tokens["alice"], transport=DjangoTransport())
    admin.request(
        "PUT", "/api/v1/price-book/", json={"gpu_hour": {"H100": "2"}, "tokens_million": {}, "gb_month": "0"}
    )
    admin.request(
        "POST",
        "/api/v1/usage/events/",
        json={
            "events": [
                {
                    "event_id": "cli-gpu",
                    "kind": "gpu",
                    "started_at": "2026-11-03T08:00:00+00:00",
                    "ended_at": "2026-11-03T11:00:00+00:00",
                    "user": "carol",
                    "project": "apollo",
                    "pool": "h100",
                    "gpus": "2",
                }
            ]
        },
    )
    lines = usage(world, "alice", capsys=capsys).splitlines()
    assert lines[0].split() == [
        "PROJECT",
        "GPU-HOURS",
        "TOKENS",
        "IN",
        "TOKENS",
        "OUT",
        "GB-HOURS",
        "COST",
        "USD",
    ]
    apollo = next(line.split() for line in lines if line.startswith("apollo"))
    assert apollo[1:4] == ["6", "5", "7"]  # 2 GPUs for 3 hours (imported now, at today's price: 12 USD)
    assert lines[-1].split()[0] == "total"
    assert lines[-1].split()[-1] == "12.00"  # what was recorded is priced as it was recorded
    by_user = usage(world, "alice", "--by", "user", "--since", "2026-11-01", capsys=capsys)
    assert any(line.split()[:2] == ["carol", "6"] for line in by_user.splitlines())
    mine = usage(world, "bob", "--by", "user", capsys=capsys)
    assert "carol" not in mine
