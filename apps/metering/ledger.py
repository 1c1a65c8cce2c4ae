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

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from functools import lru_cache
from operator import itemgetter
from typing import Any

import psycopg
from django.db import IntegrityError, connection, transaction
from django.db.models import Sum
from django.utils import timezone

from apps.accounts.models import Project, User
from apps.core.ids import as_uuid
from apps.metering.models import INSTANCE_KINDS, Kind, Period, PriceBook, Rejection
from apps.resources.models import Pool
from protocol.units import UNITS_PER_GPU

MS_PER_HOUR = 3_600_000
MS_PER_MONTH = 30 * 24 * MS_PER_HOUR  # a GB-month is 30 days
NANO = 10**9
FUTURE_SLACK = timedelta(minutes=5)
KINDS = frozenset(Kind.values)
POOLED_KINDS = frozenset({Kind.GPU, *INSTANCE_KINDS})  # events that name a pool of the tenant
ONE_MS = timedelta(milliseconds=1)
ONE_US = timedelta(microseconds=1)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # clocks differ a little; events further ahead are refused
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
    "instance_type",
    "instance_ms",
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
    instance_type: str = ""  # a cloud instance's type, for instance and idle events (they name no user)

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
            }
            | ({"instance_type": self.instance_type} if self.kind in INSTANCE_KINDS else {}),
            sort_keys=True,
        )


@dataclass(frozen=True)
class Cost:
    """What one appended event cost, and whom: for the wallets it draws from."""

    user_id: str
    project_id: str | None
    cost_nano_usd: int
    ended_at: datetime


@dataclass
class Report:
    accepted: int = 0  # appended now
    duplicates: int = 0  # seen before, same content: nothing changed
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (event id, why)
    appended: list[tuple[Any, ...]] = field(default_factory=list, repr=False)  # the ledger rows written now

    def costs(self) -> list[Cost]:
        """What each event appended now cost, and whom (those that cost anything): built when asked, since
        a large import never needs it."""
        return [
            Cost(str(row[_USER_ID]), row[_PROJECT_ID], row[_COST], row[_ENDED_AT])
            for row in self.appended
            if row[_COST] > 0 and row[_USER_ID] is not None  # a cloud instance's time is no one's spend
        ]


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
    """The users, projects and pools a batch of events names (by name or id), its periods and prices, read
    once per batch: only what the batch refers to, not every user and project of the tenant."""

    def __init__(self, now: datetime, events: list[Event]) -> None:
        self.now = now
        pooled = {event.pool for event in events if event.kind in POOLED_KINDS}
        with connection.cursor() as cursor:  # one statement: a run's end reads this for its one segment
            cursor.execute(
                _DIRECTORY,
                {
                    **_references("user", {event.user for event in events}),
                    **_references("project", {event.project for event in events if event.project}),
                    **_references("pool", pooled),
                },
            )
            users, projects, pools, closed, book = cursor.fetchone()
        self.users: dict[str, tuple[str, str]] = {}
        for pk, username in json.loads(users):
            self.users[username] = self.users[pk] = (pk, username)
        self.projects: dict[str, tuple[str, str, str]] = {}
        for pk, name, center in json.loads(projects):
            self.projects[name] = self.projects[pk] = (pk, name, center)
        self.pools: dict[str, tuple[str, str]] = {}  # name or id -> (name, GPU class)
        for pk, name, gpu_class in json.loads(pools):
            self.pools[name] = self.pools[pk] = (name, gpu_class)
        self.closed = set(closed)
        default = PriceBook()
        gpu_hour, tokens_million, gb_month, instance_hour = (
            json.loads(book)
            if book
            else (default.gpu_hour, default.tokens_million, str(default.gb_month), default.instance_hour)
        )
        prices = PriceBook(
            gpu_hour=gpu_hour, tokens_million=tokens_million, gb_month=gb_month, instance_hour=instance_hour
        )
        # nano-USD per unit-millisecond, as a fraction: a GPU-hour is 840 units x 3,600,000 ms
        self.gpu_price = {}
        for name, price in prices.gpu_hour.items():
            each = _decimal(price) * NANO / (UNITS_PER_GPU * MS_PER_HOUR)
            self.gpu_price[name] = (each.numerator, each.denominator)
        self.tokens = {
            name: (_decimal(price.get("in", 0)), _decimal(price.get("out", 0)))
            for name, price in prices.tokens_million.items()
            if isinstance(price, dict)
        }
        self.gb_month = _decimal(prices.gb_month)
        self.instance_hour = {name: _decimal(price) for name, price in (prices.instance_hour or {}).items()}
        self.current = now.date().replace(day=1)
        self.latest = now + FUTURE_SLACK

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

    def _instance_cost(self, event: Event) -> int:
        """An instance's time at its type's hourly price (or "*"'s); the source's own cost where neither."""
        hourly = self.instance_hour.get(event.instance_type, self.instance_hour.get("*"))
        if hourly is None:
            return event.cost_nano_usd or 0
        milliseconds = ((event.ended_at or event.started_at) - event.started_at) // ONE_MS
        return _rounded(hourly * NANO * milliseconds / MS_PER_HOUR)

    def cost(self, event: Event, gpu_class: str, unit_ms: int, byte_ms: int) -> int:
        if event.kind == Kind.GPU:
            price = self.gpu_price.get(gpu_class) or self.gpu_price.get("*")
            if not price or not price[0]:
                return 0
            # half up, in integers: (2 x amount x numerator + denominator) // (2 x denominator)
            return (2 * unit_ms * price[0] + price[1]) // (2 * price[1])
        if event.kind == Kind.TOKENS:
            if event.model in self.tokens:
                price_in, price_out = self.tokens[event.model]
                return _rounded((event.tokens_in * price_in + event.tokens_out * price_out) * 1000)
            return event.cost_nano_usd or 0
        if event.kind in INSTANCE_KINDS:
            return self._instance_cost(event)
        return _rounded(Fraction(byte_ms) * self.gb_month * NANO / (NANO * MS_PER_MONTH))


MAX_AMOUNT = 10**15  # tokens, bytes or nano-USD in one event: far above any real one, far below the columns'
MAX_COST = 2**62  # nano-USD in one ledger row (its column is a 64-bit integer)


def _references(kind: str, references: set[str]) -> dict[str, list[Any]]:
    """The names and ids among `references` (each a name or an id), as _DIRECTORY's parameters."""
    texts = sorted({reference for reference in references if isinstance(reference, str) and reference})
    ids = [identifier for identifier in (as_uuid(text) for text in texts) if identifier is not None]
    return {f"{kind}_names": texts, f"{kind}_ids": ids}


# The users, projects and pools a batch names (by name or id), the closed periods and the price book, in
# one round trip; each list as JSON text ([id, name, ...] per row), the price book as one JSON array.
_DIRECTORY = f"""
SELECT
  (SELECT coalesce(json_agg(json_build_array(id::text, username)), '[]')::text FROM {User._meta.db_table}
    WHERE username = ANY(%(user_names)s::text[]) OR id = ANY(%(user_ids)s::uuid[])),
  (SELECT coalesce(json_agg(json_build_array(id::text, name, cost_center)), '[]')::text
     FROM {Project._meta.db_table}
    WHERE name = ANY(%(project_names)s::text[]) OR id = ANY(%(project_ids)s::uuid[])),
  (SELECT coalesce(json_agg(json_build_array(id::text, name, gpu_class)), '[]')::text
     FROM {Pool._meta.db_table}
    WHERE name = ANY(%(pool_names)s::text[]) OR id = ANY(%(pool_ids)s::uuid[])),
  ARRAY(SELECT start FROM {Period._meta.db_table} WHERE closed_at IS NOT NULL),
  (SELECT json_build_array(gpu_hour, tokens_million, gb_month::text, instance_hour)::text
     FROM {PriceBook._meta.db_table} WHERE id = 1)
"""  # noqa: S608 -- the models' own tables


def _check_sizes(event: Event) -> None:
    """Text and amounts within what a ledger row holds, or Invalid naming the field."""
    texts = (
        ("model", 100), ("group", 100), ("pool", 100), ("compute_resource", 200), ("source", 20),
        ("instance_type", 100),
    )  # fmt: skip
    for name, longest in texts:
        text = getattr(event, name)
        if not isinstance(text, str) or len(text) > longest:
            raise Invalid(f"{name} is text of at most {longest} characters")
    for name in ("tokens_in", "tokens_out", "bytes", "cost_nano_usd"):
        amount = getattr(event, name) or 0
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise Invalid(f"{name} is a whole number")
        if not 0 <= amount <= MAX_AMOUNT:
            raise Invalid(f"{name} is from 0 to {MAX_AMOUNT:,} (tokens, bytes and costs cannot be negative)")


def _checked_times(event: Event, directory: Directory) -> datetime:
    """When the event ended (its start, for an instant), or Invalid saying what is wrong with its times."""
    if event.started_at.tzinfo is None:
        raise Invalid("started_at has no time zone")
    ended = event.ended_at or event.started_at
    if event.kind != Kind.TOKENS and event.ended_at is None:
        raise Invalid(f"a {event.kind} event needs ended_at")
    if ended.tzinfo is None:
        raise Invalid("ended_at has no time zone")
    if ended < event.started_at:
        raise Invalid(f"it ends ({ended.isoformat()}) before it starts ({event.started_at.isoformat()})")
    if ended > directory.latest:
        raise Invalid(f"it ends in the future ({ended.isoformat()})")
    return ended


def _row(event: Event, directory: Directory) -> tuple[Any, ...]:
    """The ledger row of an event, or Invalid saying what is wrong with it."""
    if not event.event_id or len(event.event_id) > 128:
        raise Invalid("an event id is 1 to 128 characters")
    if event.kind not in KINDS:
        raise Invalid(f"kind {event.kind!r} is not one of {', '.join(sorted(KINDS))}")
    ended = _checked_times(event, directory)
    _check_sizes(event)
    instance = event.kind in INSTANCE_KINDS
    if instance and not event.instance_type:
        raise Invalid(f"a {event.kind} event names its instance_type")
    user_id: str | None
    user_id, username = (None, "") if instance and not event.user else directory.user(event.user)
    project_id, project_name, cost_center = directory.project(event.project)
    milliseconds = (ended - event.started_at) // ONE_MS
    units = gpu_class = None
    pool = event.pool
    if event.kind in POOLED_KINDS:
        if event.pool not in directory.pools:
            raise Invalid(f"no pool {event.pool!r} in this tenant")
        pool, gpu_class = directory.pools[event.pool]
    if event.kind == Kind.GPU:
        units = units_of(event.gpus)
    unit_ms = (units or 0) * milliseconds
    byte_ms = event.bytes * milliseconds if event.kind == Kind.STORAGE else 0
    cost = directory.cost(event, gpu_class or "", unit_ms, byte_ms)
    if max(unit_ms, byte_ms, cost) > MAX_COST:
        raise Invalid("its GPU time, storage or cost is more than one ledger row holds; split it")
    period, late = directory.period(ended)
    # What the event says, not what the ledger made of it (its period, lateness and price): a replay must
    # say the same. Instants as microseconds since 1970 UTC, so one instant in two time zones is the same.
    said: tuple[Any, ...] = (
        event.kind, (event.started_at - EPOCH) // ONE_US, (ended - EPOCH) // ONE_US, user_id, project_id,
        event.group, pool, event.compute_resource, units, event.model, event.tokens_in,
        event.tokens_out, byte_ms,
    )  # fmt: skip
    if instance:  # (other kinds' digests stay what they were when recorded)
        said += (event.instance_type,)
    return (
        event.event_id,
        event.kind,
        hashlib.md5(repr(said).encode(), usedforsecurity=False).hexdigest(),
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
        pool,
        gpu_class or "",
        event.compute_resource,
        units or 0,
        unit_ms,
        event.model,
        event.tokens_in,
        event.tokens_out,
        byte_ms,
        cost,
        event.source,
        directory.now,
        event.instance_type if instance else "",
        milliseconds if instance else 0,
    )


_MEASURES = ("events", "gpu_unit_ms", "tokens_in", "tokens_out", "byte_ms", "instance_ms", "cost_nano_usd")
_KEY = "kind, project_id, user_id, pool, gpu_class, model"
_ROLLUP = f"INSERT INTO metering_rollup (grain, bucket, {_KEY}, {', '.join(_MEASURES)})"
_TOTALS = ", ".join(f"sum({measure})" for measure in _MEASURES)
_TYPES = ("timestamptz", "text", "uuid", "uuid", "text", "text", "text", *("numeric",) * len(_MEASURES))


def _add(table: str) -> str:
    return ", ".join(f"{measure} = {table}.{measure} + EXCLUDED.{measure}" for measure in _MEASURES)


# The sums of what was just appended, per hour and key, added to the hourly and daily rollups and to the
# provider's daily totals per tenant, in one statement.
_ROLL = f"""
WITH hours (bucket, {_KEY}, {", ".join(_MEASURES)}) AS (
    SELECT * FROM unnest({", ".join(f"%s::{kind}[]" for kind in _TYPES)})
), hourly AS (
    {_ROLLUP} SELECT 'hour', bucket, {_KEY}, {", ".join(_MEASURES)} FROM hours
    ON CONFLICT ON CONSTRAINT one_rollup_per_bucket_and_key DO UPDATE SET {_add("metering_rollup")}
), daily AS (
    {_ROLLUP} SELECT 'day', date_trunc('day', bucket), {_KEY}, {_TOTALS}
    FROM hours GROUP BY 2, 3, 4, 5, 6, 7, 8
    ON CONFLICT ON CONSTRAINT one_rollup_per_bucket_and_key DO UPDATE SET {_add("metering_rollup")}
)
INSERT INTO public.tenants_tenantusageday (tenant_id, day, kind, {", ".join(_MEASURES)})
SELECT (SELECT id FROM public.tenants_tenant WHERE schema_name = %s),
       (bucket AT TIME ZONE 'UTC')::date, kind, {_TOTALS}
FROM hours GROUP BY 2, 3
ON CONFLICT ON CONSTRAINT one_usage_row_per_tenant_day DO UPDATE SET {_add("tenants_tenantusageday")}
"""  # noqa: S608 -- made of this module's constants only
_STAGED = f"""
INSERT INTO metering_ledgerevent ({", ".join(COLUMNS)}) SELECT {", ".join(COLUMNS)} FROM kq_ledger_staging
ON CONFLICT (event_id) DO NOTHING RETURNING event_id
"""  # noqa: S608 -- made of this module's constants only
CONFLICT = "an event with this id was recorded with other content"


def ingest(events: Iterable[Event], *, now: datetime | None = None) -> Report:
    """Append `events` to the current tenant's ledger (see the module's docstring)."""
    events = list(events)
    directory = Directory(now or timezone.now(), events)
    report = Report()
    rows: list[tuple[Any, ...]] = []
    payloads: dict[str, Event] = {}
    for event in events:
        payloads[event.event_id] = event
        try:
            rows.append(_row(event, directory))
        except Invalid as invalid:
            report.rejected.append((event.event_id, str(invalid)))
    with transaction.atomic(savepoint=False):  # within a caller's transaction, its failure undoes this
        months = {row[5] for row in rows}
        Period.objects.bulk_create([Period(start=month) for month in months], ignore_conflicts=True)
        if rows:
            appended = _append(rows, report)
            report.accepted = len(appended)
            report.appended = appended
            _roll(appended)
        Rejection.objects.bulk_create(
            [
                Rejection(event_id=event_id, reason=reason, payload=_payload(payloads.get(event_id)))
                for event_id, reason in report.rejected
            ]
        )
    return report


SMALL_BATCH = 64  # up to this many rows go in one INSERT; more are copied (COPY), which costs a savepoint


def _append(rows: list[tuple[Any, ...]], report: Report) -> list[tuple[Any, ...]]:
    """Append the rows the ledger does not hold yet; the rows appended.

    A small batch (a run's segment, a few calls) is one INSERT … ON CONFLICT DO NOTHING. A larger one is
    copied straight into the ledger; when it holds an id the ledger has (a replay) or holds one twice, the
    copy fails on the primary key and the batch goes through a staging table with ON CONFLICT DO NOTHING
    instead. Either way, each row that was not appended is a duplicate if the ledger holds the same content
    under its id, and is refused if it holds other content."""
    if len(rows) <= SMALL_BATCH:
        taken = _insert(rows)
    else:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                with cursor.cursor.copy(
                    f"COPY metering_ledgerevent ({', '.join(COLUMNS)}) FROM STDIN"
                ) as copy:
                    for row in rows:
                        copy.write_row(row)
                return rows
        except (IntegrityError, psycopg.errors.UniqueViolation):  # Django's, or psycopg's own from COPY
            pass
        taken = _staged(rows)
    if len(taken) == len(rows):
        return rows  # every row new, no id twice: the usual case, with no read
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT event_id, digest FROM metering_ledgerevent WHERE event_id = ANY(%s)",
            [list({row[0] for row in rows})],
        )
        kept = dict(cursor.fetchall())
    appended = []
    for row in rows:
        event_id, digest = row[0], row[2]
        if event_id in taken and kept.get(event_id) == digest:
            taken.discard(event_id)  # the one row of this id that went in
            appended.append(row)
        elif kept.get(event_id) == digest:
            report.duplicates += 1
        else:
            report.rejected.append((event_id, CONFLICT))
    return appended


_INSERT = f"INSERT INTO metering_ledgerevent ({', '.join(COLUMNS)}) VALUES "  # noqa: S608 -- constants only
_ROW = "(" + ", ".join(["%s"] * len(COLUMNS)) + ")"


def _insert(rows: list[tuple[Any, ...]]) -> set[str]:
    """The ids of `rows` that went into the ledger, in one statement."""
    with connection.cursor() as cursor:
        cursor.execute(
            _INSERT + ", ".join([_ROW] * len(rows)) + " ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
            [value for row in rows for value in row],
        )
        return {event_id for (event_id,) in cursor.fetchall()}


def _staged(rows: list[tuple[Any, ...]]) -> set[str]:
    """The ids of `rows` that went into the ledger, through the staging table."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMP TABLE IF NOT EXISTS kq_ledger_staging "
            "(LIKE metering_ledgerevent INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        cursor.execute("TRUNCATE kq_ledger_staging")
        with cursor.cursor.copy(f"COPY kq_ledger_staging ({', '.join(COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        cursor.execute(_STAGED)
        return {event_id for (event_id,) in cursor.fetchall()}


_KEY_OF = itemgetter(
    *(COLUMNS.index(name) for name in ("kind", "project_id", "user_id", "pool", "gpu_class", "model"))
)
_MEASURES_OF = itemgetter(*(COLUMNS.index(name) for name in _MEASURES[1:]))
_ENDED_AT = COLUMNS.index("ended_at")
_USER_ID, _PROJECT_ID, _COST = (COLUMNS.index(name) for name in ("user_id", "project_id", "cost_nano_usd"))


def _roll(rows: list[tuple[Any, ...]]) -> None:
    """Add appended rows to the rollups: summed per hour and key here, then written in one statement."""
    sums: dict[tuple[Any, ...], list[int]] = {}
    for row in rows:
        ended = row[_ENDED_AT]
        if ended.utcoffset():
            ended = ended.astimezone(UTC)
        key = (ended.replace(minute=0, second=0, microsecond=0), *_KEY_OF(row))
        totals = sums.get(key)
        if totals is None:
            sums[key] = [1, *_MEASURES_OF(row)]
        else:
            totals[0] += 1
            for position, value in enumerate(_MEASURES_OF(row), 1):
                totals[position] += value
    if not sums:
        return
    columns = list(zip(*(key + tuple(totals) for key, totals in sums.items()), strict=True))
    with connection.cursor() as cursor:
        cursor.execute(_ROLL, [list(column) for column in columns] + [connection.schema_name])  # type: ignore[attr-defined]


def _payload(event: Event | None) -> dict[str, Any]:
    if event is None:
        return {}
    try:
        content: dict[str, Any] = json.loads(event.content())
    except (ValueError, TypeError, ZeroDivisionError):  # too malformed to be read back: keep its text
        content = {"raw": repr(event)[:2000]}
    return content | {"event_id": event.event_id, "source": event.source}


def amount_sums() -> dict[str, Sum]:
    """Sum() of each metered amount, for .annotate() on the ledger, its rollups or the provider's daily
    totals: gpu_unit_ms, tokens_in, tokens_out, byte_ms, instance_ms, and cost (nano-USD)."""
    return {
        "gpu_unit_ms": Sum("gpu_unit_ms"),
        "tokens_in": Sum("tokens_in"),
        "tokens_out": Sum("tokens_out"),
        "byte_ms": Sum("byte_ms"),
        "instance_ms": Sum("instance_ms"),
        "cost": Sum("cost_nano_usd"),
    }


def gpu_hours(unit_ms: int | Decimal) -> Decimal:
    """GPU-hours of a units x milliseconds figure, exact to 12 decimal places."""
    return (Decimal(unit_ms) / (UNITS_PER_GPU * MS_PER_HOUR)).quantize(Decimal("1e-12"))


def gb_hours(byte_ms: int | Decimal) -> Decimal:
    """GB-hours of a bytes x milliseconds figure, exact to 12 decimal places."""
    return (Decimal(byte_ms) / (NANO * MS_PER_HOUR)).quantize(Decimal("1e-12"))


def instance_hours(milliseconds: int | Decimal) -> Decimal:
    """Instance-hours of a milliseconds figure, exact to 12 decimal places."""
    return (Decimal(milliseconds) / MS_PER_HOUR).quantize(Decimal("1e-12"))


def usd(nano: int | Decimal) -> Decimal:
    """USD of a nano-USD figure, exact."""
    return Decimal(nano) / NANO
