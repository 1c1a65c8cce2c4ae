"""The ledger: idempotent by event id, exact, priced, rolled up, and honest about what it refuses."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_tenants.utils import schema_context

from apps.accounts.models import Project, User
from apps.metering.ledger import CONFLICT, SMALL_BATCH, Directory, Event, gpu_hours, ingest
from apps.metering.models import LedgerEvent, Period, PriceBook, Rejection, Rollup
from apps.resources.models import Pool
from tenants.models import TenantUsageDay
from tests.world import World

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)
HOUR = timedelta(hours=1)


def gpu(event_id: str, gpus: str | int = 1, hours: float = 1, **fields: object) -> Event:
    start = NOW - timedelta(hours=hours) - HOUR
    values: dict[str, object] = {
        "event_id": event_id,
        "kind": "gpu",
        "started_at": start,
        "ended_at": start + timedelta(hours=hours),
        "user": "bob",
        "project": "apollo",
        "pool": "h100",
        "gpus": gpus,
        "source": "scheduler",
        **fields,
    }
    return Event(**values)  # type: ignore[arg-type]


def tokens(event_id: str, tokens_in: int = 1000, tokens_out: int = 500, **fields: object) -> Event:
    values: dict[str, object] = {
        "event_id": event_id,
        "kind": "tokens",
        "started_at": NOW - HOUR,
        "user": "bob",
        "project": "apollo",
        "model": "chat",
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "cost_nano_usd": 123,
        "source": "gateway",
        **fields,
    }
    return Event(**values)  # type: ignore[arg-type]


@pytest.fixture
def acme(world: World) -> object:
    with schema_context("acme"):
        PriceBook.objects.update_or_create(
            pk=1,
            defaults={
                "gpu_hour": {"H100": "2.50", "*": "1.00"},
                "tokens_million": {"chat": {"in": "0.15", "out": "0.60"}},
                "gb_month": Decimal("0.02"),
            },
        )
        yield world


def test_replaying_the_same_events_changes_nothing(acme: World) -> None:
    events = [gpu("run-1"), gpu("run-2", gpus="0.25"), tokens("call-1")]
    first = ingest(events, now=NOW)
    assert (first.accepted, first.duplicates, first.rejected) == (3, 0, [])
    rollups = list(
        Rollup.objects.values_list("grain", "kind", "events", "cost_nano_usd").order_by("grain", "kind")
    )
    again = ingest(list(reversed(events)), now=NOW + timedelta(days=3))
    assert (again.accepted, again.duplicates, again.rejected) == (0, 3, [])
    assert LedgerEvent.objects.filter(event_id__in=["run-1", "run-2", "call-1"]).count() == 3
    assert (
        list(Rollup.objects.values_list("grain", "kind", "events", "cost_nano_usd").order_by("grain", "kind"))
        == rollups
    )


@pytest.mark.parametrize("size", [3, SMALL_BATCH + 6], ids=["one-insert", "copied"])
def test_either_way_in_a_batch_keeps_each_event_once_and_refuses_a_changed_one(
    acme: World, size: int
) -> None:
    """A small batch is one INSERT, a large one a COPY (through the staging table once it meets an id
    the ledger holds): both keep new events once, count replays, and refuse other content under a
    known id."""

    def hourly() -> int:
        return sum(Rollup.objects.filter(grain="hour", kind="tokens").values_list("events", flat=True))

    before = hourly()
    events = [tokens(f"call-{index}") for index in range(size)]
    first = ingest(events, now=NOW)
    assert (first.accepted, first.duplicates, first.rejected) == (size, 0, [])
    changed = tokens("call-0", tokens_in=7)
    again = ingest([*events, tokens("call-new"), tokens("call-new"), changed], now=NOW)
    assert (again.accepted, again.duplicates) == (1, size + 1)
    assert again.rejected == [("call-0", CONFLICT)]
    assert LedgerEvent.objects.filter(event_id__startswith="call-").count() == size + 1
    assert LedgerEvent.objects.get(event_id="call-0").tokens_in == 1000  # the first one stands
    assert hourly() == before + size + 1


def test_prices_come_from_the_price_book_exactly(acme: World) -> None:
    ingest(
        [gpu("h100-quarter", gpus="0.25", hours=2), tokens("call"), gpu("a100", pool="baremetal")], now=NOW
    )
    quarter = LedgerEvent.objects.get(event_id="h100-quarter")
    assert (quarter.gpu_units, quarter.gpu_class) == (210, "H100")
    assert gpu_hours(quarter.gpu_unit_ms) == Decimal("0.5")  # a quarter GPU for two hours
    assert quarter.cost_nano_usd == 1_250_000_000  # 0.5 GPU-hours at 2.50
    assert LedgerEvent.objects.get(event_id="a100").cost_nano_usd == 1_000_000_000  # the "*" price
    # 1,000 in at 0.15 and 500 out at 0.60 per million: the book's price, not the gateway's 123.
    assert LedgerEvent.objects.get(event_id="call").cost_nano_usd == 150_000 + 300_000


def test_a_batch_reads_whom_and_what_it_names_by_name_or_id_in_one_statement(acme: World) -> None:
    bob, apollo = User.objects.get(username="bob"), Project.objects.get(name="apollo")
    h100 = Pool.objects.get(name="h100")
    by_id = gpu("by-id", user=str(bob.pk), project=str(apollo.pk), pool=str(h100.pk))
    Period.objects.create(start=datetime(2026, 10, 1, tzinfo=UTC).date(), closed_at=NOW)
    with CaptureQueriesContext(connection) as queries:
        directory = Directory(NOW, [gpu("by-name"), by_id, tokens("call")])
    assert len(queries) == 1  # was five: users, projects, pools, periods and prices
    assert directory.user(str(bob.pk)) == directory.user("bob") == (str(bob.pk), "bob")
    assert directory.project(str(apollo.pk)) == directory.project("apollo")
    assert directory.pools[str(h100.pk)] == directory.pools["h100"] == ("h100", "H100")
    assert directory.closed == {datetime(2026, 10, 1, tzinfo=UTC).date()}
    assert directory.gb_month == Fraction("0.02")
    assert directory.tokens["chat"] == (Fraction("0.15"), Fraction("0.60"))
    assert "baremetal" not in directory.pools  # only what the batch names
    report = ingest([gpu("by-name"), by_id], now=NOW)
    assert report.accepted == 2
    rows = LedgerEvent.objects.filter(event_id__in=["by-name", "by-id"])
    assert {(row.username, row.project_name, row.pool, row.cost_nano_usd) for row in rows} == {
        ("bob", "apollo", "h100", 2_500_000_000)
    }
    PriceBook.objects.all().delete()
    bare = Directory(NOW, [gpu("free")])
    assert not bare.gpu_price
    assert not bare.tokens
    assert bare.gb_month == Fraction(0)
    assert Directory(NOW, []).users == {}


def test_an_id_seen_with_other_content_is_refused_and_kept_aside(acme: World) -> None:
    ingest([gpu("run-1")], now=NOW)
    report = ingest([gpu("run-1", gpus=2), gpu("run-9")], now=NOW)
    assert report.accepted == 1
    assert report.rejected == [("run-1", "an event with this id was recorded with other content")]
    assert LedgerEvent.objects.get(event_id="run-1").gpu_units == 840  # the first one stands
    kept = Rejection.objects.get(event_id="run-1")
    assert kept.payload["gpus"] == "2"


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (gpu("e1", user="nobody"), "no user 'nobody' in this tenant"),
        (gpu("e2", pool="tpu-pod"), "no pool 'tpu-pod' in this tenant"),
        (gpu("e3", project="zeus"), "no project 'zeus' in this tenant"),
        (gpu("e4", hours=-1), "before it starts"),
        (gpu("e5", gpus="0.3333"), "not a positive whole number of 1/840 GPU shares"),
        (gpu("e6", gpus="0"), "not a positive whole number"),
        (tokens("e7", tokens_in=-5), "cannot be negative"),
        (gpu("e8", ended_at=NOW + timedelta(hours=2)), "ends in the future"),
        (
            Event(event_id="e9", kind="gpu", started_at=NOW - HOUR, user="bob", pool="h100", gpus=1),
            "needs ended_at",
        ),
        (
            Event(event_id="e10", kind="power", started_at=NOW - HOUR, user="bob"),
            "kind 'power' is not one of",
        ),
    ],
)
def test_bad_events_are_refused_with_the_reason(acme: World, event: Event, reason: str) -> None:
    report = ingest([event, tokens("fine")], now=NOW)
    assert report.accepted == 1
    ((event_id, why),) = report.rejected
    assert event_id == event.event_id
    assert reason in why
    assert Rejection.objects.filter(event_id=event.event_id).exists()
    assert not LedgerEvent.objects.filter(event_id=event.event_id).exists()


def test_a_late_event_lands_in_the_oldest_open_period(acme: World) -> None:
    october = datetime(2026, 10, 20, 9, tzinfo=UTC)
    Period.objects.create(start=october.date().replace(day=1), closed_at=NOW - timedelta(days=20))
    ingest([gpu("late", started_at=october, ended_at=october + HOUR)], now=NOW)
    late = LedgerEvent.objects.get(event_id="late")
    assert (late.period.isoformat(), late.late) == ("2026-11-01", True)
    ingest([gpu("on-time")], now=NOW)
    assert not LedgerEvent.objects.get(event_id="on-time").late


def test_fractions_and_mig_slices_add_up_exactly_over_a_million_events(acme: World) -> None:
    shares = ["1/7", "1/8", "0.25", "1/3", "3/7", "1", "2", "5/8"]  # MIG slices, fractions, whole GPUs
    rng = random.Random(11)
    start = NOW - timedelta(days=20)
    expected = Fraction(0)
    count = 1_000_000
    events = []
    for index in range(count):
        share = rng.choice(shares)
        milliseconds = rng.randrange(1, 3_600_000)
        expected += Fraction(share) * milliseconds
        begin = start + timedelta(milliseconds=index)
        events.append(
            Event(
                event_id=f"f{index}",
                kind="gpu",
                started_at=begin,
                ended_at=begin + timedelta(milliseconds=milliseconds),
                user="bob",
                pool="h100",
                gpus=share,
            )
        )
    assert ingest(events, now=NOW).accepted == count
    total = Rollup.objects.filter(grain="day", kind="gpu").values_list("gpu_unit_ms", flat=True)
    unit_ms = sum(total, Decimal(0))
    assert Fraction(int(unit_ms), 840) == expected  # GPU-milliseconds, to the last one


def test_the_providers_totals_match_the_tenants_ledgers(acme: World) -> None:
    ingest([gpu("a-run"), tokens("a-call")], now=NOW)
    with schema_context("globex"):
        ingest([tokens("b-call", user="charlie", project="hermes")], now=NOW)
    for tenant, schema in ((acme.tenant_a, "acme"), (acme.tenant_b, "globex")):
        with schema_context(schema):
            ledger = {
                (
                    kind,
                    int(sum(LedgerEvent.objects.filter(kind=kind).values_list("cost_nano_usd", flat=True))),
                )
                for kind in ("gpu", "tokens")
                if LedgerEvent.objects.filter(kind=kind).exists()
            }
        days = TenantUsageDay.objects.filter(tenant=tenant)
        provider = {
            (kind, int(sum(row.cost_nano_usd for row in days if row.kind == kind))) for kind, _ in ledger
        }
        assert provider == ledger
        assert {row.kind for row in days} == {kind for kind, _ in ledger}


def test_the_provider_reads_usage_per_tenant_without_tenant_schemas(acme: World) -> None:
    from apps.provider.selectors import usage_by_tenant

    ingest([gpu("provider-run", gpus=2, hours=1)], now=NOW)
    rows = {(row["tenant"], row["kind"]): row for row in usage_by_tenant()}
    assert rows[("acme", "gpu")]["gpu_hours"] == "2.000000"
    assert rows[("acme", "gpu")]["cost_usd"] == "5.000000"  # 2 GPU-hours of H100 at 2.50
    assert ("acme", "tokens") in rows  # the world's own gateway call
    assert not any(tenant == "globex" for tenant, _ in rows)
