"""What the ledger holds, as the API, the portal and the wallets read it."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db.models import QuerySet, Sum
from django.db.models.functions import Substr

from apps.accounts.models import Project, Role, User
from apps.core.errors import InvalidInput
from apps.metering.ledger import amount_sums, gb_hours, gpu_hours, instance_hours, usd
from apps.metering.models import Kind, LedgerEvent, Period, PriceBook, Rejection, Rollup
from apps.metering.runs import segment_prefix


def task_gpu_usage(*, task_id: Any, user_id: Any, since: datetime) -> dict[str, Any] | None:
    """The GPU time (units x milliseconds) and cost (nano-USD) the ledger holds for a task's runs, or None
    before any. Read through the ledger's (user, started_at) index: the submitter's events since the task
    was submitted, not the whole ledger."""
    sums = LedgerEvent.objects.filter(
        user_id=user_id, started_at__gte=since, kind=Kind.GPU, event_id__startswith=segment_prefix(task_id)
    ).aggregate(**amount_sums())
    return None if sums["gpu_unit_ms"] is None else sums


def tasks_gpu_usage(tasks: list[tuple[Any, Any, datetime]]) -> dict[str, dict[str, Any]]:
    """task_gpu_usage for many tasks, each (task id, submitter id, submitted at), in one query: by task id,
    for the tasks the ledger holds GPU time of."""
    if not tasks:
        return {}
    prefixes = {segment_prefix(task_id): str(task_id) for task_id, _, _ in tasks}
    width = len(next(iter(prefixes)))  # every task id has the same length
    sums = (
        LedgerEvent.objects.filter(
            user_id__in={user_id for _, user_id, _ in tasks},
            started_at__gte=min(since for _, _, since in tasks),
            kind=Kind.GPU,
        )
        .annotate(prefix=Substr("event_id", 1, width))
        .filter(prefix__in=list(prefixes))
        .values("prefix")
        .annotate(**amount_sums())
    )
    return {prefixes[str(row["prefix"])]: dict(row) for row in sums}


def compute_cost(*, since: datetime, project_id: Any = None, user_id: Any = None) -> int:
    """The GPU and storage cost (nano-USD) metered since `since` for a project, a user, or everyone."""
    events = LedgerEvent.objects.filter(kind__in=(Kind.GPU, Kind.STORAGE), ended_at__gte=since)
    if project_id is not None:
        events = events.filter(project_id=project_id)
    if user_id is not None:
        events = events.filter(user_id=user_id)
    return int(events.aggregate(cost=Sum("cost_nano_usd"))["cost"] or 0)


def usage_for(user: User) -> QuerySet[LedgerEvent]:
    """The ledger events a user may read: everyone's for admins, their own otherwise."""
    events = LedgerEvent.objects.all()
    return events if user.has_role(Role.ADMIN) else events.filter(user_id=user.pk)


def usage_filtered(events: QuerySet[Any], query: dict[str, str], *, time_field: str) -> QuerySet[Any]:
    """`events` narrowed by the usage API's filters (kind, user, project, pool, since, until)."""
    filters = {"kind": "kind", "user": "username", "project": "project_name", "pool": "pool"}
    for parameter, column in filters.items():
        if query.get(parameter) and (parameter != "user" or time_field == "started_at"):
            events = events.filter(**{column: query[parameter]})
    for bound, lookup in (("since", "gte"), ("until", "lt")):
        if query.get(bound):
            try:
                moment = datetime.fromisoformat(query[bound])
            except ValueError:
                raise InvalidInput(
                    f"{bound}: an ISO 8601 time, as 2026-11-01T00:00:00Z.", field=bound
                ) from None
            events = events.filter(**{f"{time_field}__{lookup}": moment})
    return events


SUMMARY_KEYS = {"project": "project_id", "user": "user_id", "pool": "pool", "gpu_class": "gpu_class",
                "model": "model", "kind": "kind"}  # fmt: skip
SIX = Decimal("0.000001")


def usd_text(nano: int | Decimal) -> str:
    """USD of a nano-USD figure, as the API shows amounts: to the millionth."""
    return str(usd(nano).quantize(SIX))


def gpu_hours_text(unit_ms: int | Decimal) -> str:
    return str(gpu_hours(unit_ms).quantize(SIX))


def instance_hours_text(milliseconds: int | Decimal) -> str:
    return str(instance_hours(milliseconds).quantize(SIX))


def gb_hours_text(byte_ms: int | Decimal) -> str:
    return str(gb_hours(byte_ms).quantize(SIX))


def usage_summary(*, user_id: Any, by: str, grain: str, bounds: dict[str, str]) -> dict[str, Any]:
    """Totals of the ledger's hourly or daily rollups grouped `by` one of SUMMARY_KEYS, for one user (or
    everyone, with user_id None), within `bounds` (kind, since, until): events, GPU-hours, tokens in and
    out, GB-hours and cost, with the total cost. The usage API and the MCP server both answer with it."""
    if by not in SUMMARY_KEYS or grain not in Rollup.Grain.values:
        raise InvalidInput(f"by is one of {', '.join(SUMMARY_KEYS)}; grain is hour or day.", field="by")
    rollups = Rollup.objects.filter(grain=grain)
    if user_id is not None:
        rollups = rollups.filter(user_id=user_id)
    rollups = usage_filtered(rollups, bounds, time_field="bucket")
    column = SUMMARY_KEYS[by]
    rows = rollups.values(column).annotate(events=Sum("events"), **amount_sums())
    labels = names(column)
    result = [
        {
            by: labels.get(str(row[column]), str(row[column] or ""))
            if column.endswith("_id")
            else row[column],
            "events": int(row["events"]),
            "gpu_hours": gpu_hours_text(row["gpu_unit_ms"]),
            "tokens_in": int(row["tokens_in"]),
            "tokens_out": int(row["tokens_out"]),
            "gb_hours": gb_hours_text(row["byte_ms"]),
            "cost_usd": usd_text(row["cost"]),
        }
        for row in rows.order_by(column)
    ]
    total = sum((Decimal(row["cost_usd"]) for row in result), Decimal(0))
    return {"by": by, "grain": grain, "rows": result, "total_cost_usd": str(total)}


def price_book() -> PriceBook:
    return PriceBook.objects.filter(pk=1).first() or PriceBook(pk=1)


def rejections() -> QuerySet[Rejection]:
    return Rejection.objects.all()


def names(column: str) -> dict[str, str]:
    """Names for the ids a summary groups by (projects and users), so it reads as people do."""
    if column == "project_id":
        return {str(pk): name for pk, name in Project.objects.values_list("pk", "name")}
    if column == "user_id":
        return {str(pk): name for pk, name in User.objects.values_list("pk", "username")}
    return {}


def periods() -> QuerySet[Period]:
    return Period.objects.all()


def instance_time(*, since: datetime) -> dict[str, dict[str, int]]:
    """Cloud instances' time in the ledger that ended since `since`, per instance name: milliseconds and
    nano-USD while they ran work (busy) and while they did not (idle)."""
    events = LedgerEvent.objects.filter(kind__in=(Kind.INSTANCE, Kind.IDLE), ended_at__gte=since)
    found: dict[str, dict[str, int]] = {}
    rows = events.values_list("event_id", "kind", "instance_ms", "cost_nano_usd")
    for event_id, kind, milliseconds, cost in rows:
        name = event_id.split(":", 2)[1]
        figures = found.setdefault(name, {"busy_ms": 0, "idle_ms": 0, "busy_nano_usd": 0, "idle_nano_usd": 0})
        side = "busy" if kind == Kind.INSTANCE else "idle"
        figures[f"{side}_ms"] += milliseconds
        figures[f"{side}_nano_usd"] += cost
    return found
