"""Writing the ledger: events checked, priced and appended once each, with their rollups, in one statement.

`ingest` takes any number of events from any source (the scheduler's run segments, the gateway's calls,
storage, an import). It checks each against the tenant (its users, projects and pools exist; times are in
order; GPU shares are exact), prices it with the tenant's price book, then copies the batch into a
temporary table and appends it with `INSERT ... ON CONFLICT (event_id) DO NOTHING`, keeping the hourly
and daily rollups and the provider's per-tenant daily totals in the same statement. An event id seen
before with the same content changes nothing (replays are free); with different content it is refused
and kept in the rejections table with the reason, never merged. Event ids are kept for good, well past
the 35 days within which Stripe may still receive usage for a period.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from functools import lru_cache
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from apps.accounts.models import Project, User
from apps.core.ids import as_uuid
from apps.metering.models import Kind, LedgerEvent, Period, PriceBook, Rejection
from apps.resources.models import Pool

UNITS_PER_GPU = 840
MS_PER_HOUR = 3_600_000
MS_PER_MONTH = 30 * 24 * MS_PER_HOUR  # a GB-month is 30 days
NANO = 10**9
FUTURE_SLACK = timedelta(minutes=5)
KINDS = frozenset(Kind.values)
ONE_MS = timedelta(milliseconds=1)  # clocks differ a little; events further ahead are refused
COLUMNS = (
    "event_id",
    "kind",
    "digest",
    "started_at",
    "ended_at",
    "period",
    "late",
    "user_id",
    "username",
    "project_id",
    "project_name",
    "cost_center",
    "group_name",
    "pool",
    "gpu_class",
    "compute_resource",
    "gpu_units",
    "gpu_unit_ms",
    "model",
    "tokens_in",
    "tokens_out",
    "byte_ms",
    "cost_nano_usd",
    "source",
    "recorded_at",
)


@dataclass(frozen=True)
class Event:
    """A usage event as a source reports it. `user`, `project` and `pool` are names or ids."""

    event_id: str
    kind: str
    started_at: datetime
    ended_at: datetime | None = None  # required for gpu and storage; a gateway call is an instant
    user: str = ""
    project: str = ""
    group: str = ""
    pool: str = ""
    compute_resource: str = ""
    gpus: str | int | Fraction = 0  # "0.25", "1/7", 2: exact shares of a GPU
    model: str = ""
    tokens_in: int = 0
    tokens_out: int = 0
    bytes: int = 0
    cost_nano_usd: int | None = None  # the source's own cost, where the price book has no price
    source: str = "import"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Event:
        """An event from JSON (the import API); raises ValueError saying what is wrong."""
        known = set(cls.__dataclass_fields__)
        if unknown := set(data) - known:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        values = dict(data)
        for name in ("started_at", "ended_at"):
            if isinstance(values.get(name), str):
                try:
                    values[name] = datetime.fromisoformat(values[name])
                except ValueError:
                    raise ValueError(f"{name} is not an ISO 8601 time: {values[name]!r}") from None
        if not isinstance(values.get("started_at"), datetime):
            raise ValueError("started_at is required")  # noqa: TRY004 -- a bad value, told as such
        values.setdefault("source", "import")
        return cls(**values)

    def content(self) -> str:
        """What the event says, canonically: a replay must say the same."""
        return json.dumps(
            {
                "kind": self.kind,
                "started_at": self.started_at.astimezone(UTC).isoformat(),
                "ended_at": self.ended_at.astimezone(UTC).isoformat() if self.ended_at else None,
                "user": self.user,
                "project": self.project,
                "group": self.group,
                "pool": self.pool,
                "compute_resource": self.compute_resource,
                "gpus": str(Fraction(self.gpus)) if self.kind == Kind.GPU else "0",
                "model": self.model,
                "tokens_in": self.tokens_in,
                "tokens_out": self.tokens_out,
                "bytes": self.bytes,
                "cost_nano_usd": self.cost_nano_usd,
            },
            sort_keys=True,
        )


@dataclass
class Report:
    accepted: int = 0  # appended now
    duplicates: int = 0  # seen before, same content: nothing changed
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (event id, why)


class Invalid(ValueError):
    pass


@lru_cache(maxsize=1024)
def units_of(gpus: str | int | Fraction) -> int:
    """A GPU share as whole 1/840 units, or Invalid when it is not exactly that."""
    try:
        share = Fraction(gpus)
    except (ValueError, ZeroDivisionError, TypeError):
        raise Invalid(f"gpus {gpus!r} is not a number of GPUs, as 2, 0.25 or 1/7") from None
    units = share * UNITS_PER_GPU
    if share <= 0 or units.denominator != 1:
        raise Invalid(f"gpus {gpus!r} is not a positive whole number of 1/{UNITS_PER_GPU} GPU shares")
    return int(units)


def _decimal(value: Any) -> Fraction:
    try:
        return Fraction(Decimal(str(value)))
    except (InvalidOperation, ValueError):
        return Fraction(0)


def _rounded(value: Fraction) -> int:
    return math.floor(value + Fraction(1, 2))  # half up


class Directory:
    """The tenant's users, projects, pools, periods and prices, read once per batch."""

    def __init__(self, now: datetime) -> None:
        self.now = now
        self.users: dict[str, tuple[str, str]] = {}
        for pk, username in User.objects.values_list("pk", "username"):
            self.users[username] = self.users[str(pk)] = (str(pk), username)
        self.projects: dict[str, tuple[str, str, str]] = {}
        for pk, name, center in Project.objects.values_list("pk", "name", "cost_center"):
            self.projects[name] = self.projects[str(pk)] = (str(pk), name, center)
        self.pools = dict(Pool.objects.values_list("name", "gpu_class"))
        self.closed = set(Period.objects.filter(closed_at__isnull=False).values_list("start", flat=True))
        prices = PriceBook.objects.filter(pk=1).first() or PriceBook()
        # nano-USD per unit-millisecond, as a fraction: a GPU-hour is 840 units x 3,600,000 ms
        self.gpu_price = {
            name: _decimal(price) * NANO / (UNITS_PER_GPU * MS_PER_HOUR)
            for name, price in prices.gpu_hour.items()
        }
        self.tokens = {
            name: (_decimal(price.get("in", 0)), _decimal(price.get("out", 0)))
            for name, price in prices.tokens_million.items()
            if isinstance(price, dict)
        }
        self.gb_month = _decimal(prices.gb_month)
        self.current = now.date().replace(day=1)

    def period(self, ended: datetime) -> tuple[date, bool]:
        if ended.utcoffset():
            ended = ended.astimezone(UTC)
        month = date(ended.year, ended.month, 1)
        if month not in self.closed:
            return month, False
        open_month = month
        while open_month in self.closed:  # the oldest open month after it
            open_month = (open_month + timedelta(days=32)).replace(day=1)
        return open_month, True

    def user(self, reference: str) -> tuple[str, str]:
        found = self.users.get(reference) or self.users.get(str(as_uuid(reference) or ""))
        if found is None:
            raise Invalid(f"no user {reference!r} in this tenant")
        return found

    def project(self, reference: str) -> tuple[str | None, str, str]:
        if not reference:
            return None, "", ""
        found = self.projects.get(reference) or self.projects.get(str(as_uuid(reference) or ""))
        if found is None:
            raise Invalid(f"no project {reference!r} in this tenant")
        return found

    def cost(self, event: Event, gpu_class: str, unit_ms: int, byte_ms: int) -> int:
        if event.kind == Kind.GPU:
            price = self.gpu_price.get(gpu_class) or self.gpu_price.get("*")
            if not price:
                return 0
            # half up, in integers: (2 x amount x numerator + denominator) // (2 x denominator)
            return (2 * unit_ms * price.numerator + price.denominator) // (2 * price.denominator)
        if event.kind == Kind.TOKENS:
            if event.model in self.tokens:
                price_in, price_out = self.tokens[event.model]
                return _rounded((event.tokens_in * price_in + event.tokens_out * price_out) * 1000)
            return event.cost_nano_usd or 0
        return _rounded(Fraction(byte_ms) * self.gb_month * NANO / (NANO * MS_PER_MONTH))


def _row(event: Event, directory: Directory) -> tuple[Any, ...]:
    """The ledger row of an event, or Invalid saying what is wrong with it."""
    if not event.event_id or len(event.event_id) > 128:
        raise Invalid("an event id is 1 to 128 characters")
    if event.kind not in KINDS:
        raise Invalid(f"kind {event.kind!r} is not one of {', '.join(sorted(KINDS))}")
    if event.started_at.tzinfo is None:
        raise Invalid("started_at has no time zone")
    ended = event.ended_at or event.started_at
    if event.kind != Kind.TOKENS and event.ended_at is None:
        raise Invalid(f"a {event.kind} event needs ended_at")
    if ended.tzinfo is None:
        raise Invalid("ended_at has no time zone")
    if ended < event.started_at:
        raise Invalid(f"it ends ({ended.isoformat()}) before it starts ({event.started_at.isoformat()})")
    if ended > directory.now + FUTURE_SLACK:
        raise Invalid(f"it ends in the future ({ended.isoformat()})")
    if min(event.tokens_in, event.tokens_out, event.bytes, event.cost_nano_usd or 0) < 0:
        raise Invalid("tokens, bytes and costs cannot be negative")
    user_id, username = directory.user(event.user)
    project_id, project_name, cost_center = directory.project(event.project)
    milliseconds = (ended - event.started_at) // ONE_MS
    units = gpu_class = None
    if event.kind == Kind.GPU:
        if event.pool not in directory.pools:
            raise Invalid(f"no pool {event.pool!r} in this tenant")
        units, gpu_class = units_of(event.gpus), directory.pools[event.pool]
    unit_ms = (units or 0) * milliseconds
    byte_ms = event.bytes * milliseconds if event.kind == Kind.STORAGE else 0
    period, late = directory.period(ended)
    return (
        event.event_id,
        event.kind,
        "",  # the digest is computed by PostgreSQL (DIGEST)
        event.started_at,
        ended,
        period,
        late,
        user_id,
        username,
        project_id,
        project_name,
        cost_center,
        event.group,
        event.pool,
        gpu_class or "",
        event.compute_resource,
        units or 0,
        unit_ms,
        event.model,
        event.tokens_in,
        event.tokens_out,
        byte_ms,
        directory.cost(event, gpu_class or "", unit_ms, byte_ms),
        event.source,
        directory.now,
    )


# What an event says (not what the ledger made of it: its period, lateness and price), as one hash.
DIGEST = (
    "md5(concat_ws('|', kind, started_at AT TIME ZONE 'UTC', ended_at AT TIME ZONE 'UTC', user_id, "
    "project_id, group_name, pool, compute_resource, gpu_units, model, tokens_in, tokens_out, byte_ms))"
)
_STAGED = ", ".join(DIGEST if column == "digest" else column for column in COLUMNS)
_MEASURES = ("events", "gpu_unit_ms", "tokens_in", "tokens_out", "byte_ms", "cost_nano_usd")
_KEY = "kind, project_id, user_id, pool, gpu_class, model"
_ROLLUP = f"INSERT INTO metering_rollup (grain, bucket, {_KEY}, {', '.join(_MEASURES)})"
_TOTALS = ", ".join(f"sum({measure})" for measure in _MEASURES)


def _add(table: str) -> str:
    return ", ".join(f"{measure} = {table}.{measure} + EXCLUDED.{measure}" for measure in _MEASURES)


# One statement: append what is new, sum it once per hour and key, and add those sums to the hourly and
# daily rollups and to the provider's daily totals per tenant.
_APPEND = f"""
WITH inserted AS (
    INSERT INTO metering_ledgerevent ({", ".join(COLUMNS)})
    SELECT {_STAGED} FROM kq_ledger_staging
    ON CONFLICT (event_id) DO NOTHING
    RETURNING ended_at, {_KEY}, gpu_unit_ms, tokens_in, tokens_out, byte_ms, cost_nano_usd
), hours AS (
    SELECT date_trunc('hour', ended_at) AS bucket, {_KEY}, count(*) AS events,
           sum(gpu_unit_ms) AS gpu_unit_ms, sum(tokens_in) AS tokens_in, sum(tokens_out) AS tokens_out,
           sum(byte_ms) AS byte_ms,
           sum(cost_nano_usd) AS cost_nano_usd
    FROM inserted GROUP BY 1, 2, 3, 4, 5, 6, 7
), hourly AS (
    {_ROLLUP} SELECT 'hour', bucket, {_KEY}, {", ".join(_MEASURES)} FROM hours
    ON CONFLICT ON CONSTRAINT one_rollup_per_bucket_and_key DO UPDATE SET {_add("metering_rollup")}
), daily AS (
    {_ROLLUP} SELECT 'day', date_trunc('day', bucket), {_KEY}, {_TOTALS}
    FROM hours GROUP BY 2, 3, 4, 5, 6, 7, 8
    ON CONFLICT ON CONSTRAINT one_rollup_per_bucket_and_key DO UPDATE SET {_add("metering_rollup")}
), provider AS (
    INSERT INTO public.tenants_tenantusageday (tenant_id, day, kind, {", ".join(_MEASURES)})
    SELECT (SELECT id FROM public.tenants_tenant WHERE schema_name = %s),
           (bucket AT TIME ZONE 'UTC')::date, kind, {_TOTALS}
    FROM hours GROUP BY 2, 3
    ON CONFLICT ON CONSTRAINT one_usage_row_per_tenant_day DO UPDATE SET {_add("tenants_tenantusageday")}
)
SELECT coalesce(sum(events), 0) FROM hours
"""  # noqa: S608 -- made of this module's constants only
_CONFLICTS = f"""
SELECT staged.event_id FROM (SELECT event_id, {DIGEST} AS digest FROM kq_ledger_staging) staged
JOIN metering_ledgerevent kept ON kept.event_id = staged.event_id AND kept.digest <> staged.digest
"""  # noqa: S608 -- made of this module's constants only


def ingest(events: Iterable[Event], *, now: datetime | None = None) -> Report:
    """Append `events` to the current tenant's ledger (see the module's docstring)."""
    directory = Directory(now or timezone.now())
    report = Report()
    rows: list[tuple[Any, ...]] = []
    payloads: dict[str, Event] = {}
    for event in events:
        payloads[event.event_id] = event
        try:
            rows.append(_row(event, directory))
        except Invalid as invalid:
            report.rejected.append((event.event_id, str(invalid)))
    with transaction.atomic():
        months = {row[5] for row in rows}
        Period.objects.bulk_create([Period(start=month) for month in months], ignore_conflicts=True)
        if rows:
            report.accepted = _append(rows)
            report.duplicates = len(rows) - report.accepted
        if report.duplicates:  # only then can a replay disagree with what was kept
            with connection.cursor() as cursor:
                cursor.execute(_CONFLICTS)
                for (event_id,) in cursor.fetchall():
                    report.rejected.append(
                        (event_id, "an event with this id was recorded with other content")
                    )
                    report.duplicates -= 1
        Rejection.objects.bulk_create(
            [
                Rejection(event_id=event_id, reason=reason, payload=_payload(payloads.get(event_id)))
                for event_id, reason in report.rejected
            ]
        )
    return report


def _append(rows: list[tuple[Any, ...]]) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMP TABLE IF NOT EXISTS kq_ledger_staging "
            "(LIKE metering_ledgerevent INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        cursor.execute("TRUNCATE kq_ledger_staging")
        raw = cursor.cursor  # psycopg's own cursor, for COPY
        with raw.copy(f"COPY kq_ledger_staging ({', '.join(COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        cursor.execute(_APPEND, [connection.schema_name])  # type: ignore[attr-defined]
        (accepted,) = cursor.fetchone()
        return int(accepted)


def _payload(event: Event | None) -> dict[str, Any]:
    if event is None:
        return {}
    try:
        content: dict[str, Any] = json.loads(event.content())
    except (ValueError, TypeError, ZeroDivisionError):  # too malformed to be read back: keep its text
        content = {"raw": repr(event)[:2000]}
    return content | {"event_id": event.event_id, "source": event.source}


def gpu_hours(unit_ms: int | Decimal) -> Decimal:
    """GPU-hours of a units x milliseconds figure, exact to 12 decimal places."""
    return (Decimal(unit_ms) / (UNITS_PER_GPU * MS_PER_HOUR)).quantize(Decimal("1e-12"))


def ledger_events() -> Any:
    return LedgerEvent.objects.all()
