"""The ledger's writers for the rest of Klique: run segments from the scheduler, gateway calls, storage;
and what the API reads: usage, summaries, the price book."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from apps.accounts.models import Role, User
from apps.core.errors import InvalidInput
from apps.metering.ledger import Event, Report, ingest
from apps.metering.models import Kind, LedgerEvent, Period, PriceBook, Rejection
from protocol.units import UNITS_PER_GPU


def run_segment(
    *,
    task_id: str,
    started_at: datetime,
    ended_at: datetime,
    username: str,
    project: str,
    group: str,
    pool: str,
    compute_resource: str,
    units: int,
) -> Report:
    """Meter one segment of a task's run: its GPUs from started_at to ended_at. A run is metered hour by
    hour while it runs and the rest when it stops (completed, failed, aborted or preempted), in the
    transaction that stops it; a preempted run's next run starts segments of its own. The segment's
    start names it, so writing one twice counts once."""
    from fractions import Fraction

    event = Event(
        event_id=_segment_prefix(task_id) + started_at.isoformat(),
        kind=Kind.GPU,
        started_at=started_at,
        ended_at=max(ended_at, started_at),
        user=username,
        project=project,
        group=group,
        pool=pool,
        compute_resource=compute_resource,
        gpus=Fraction(units, UNITS_PER_GPU),
        source="scheduler",
    )
    report = ingest([event], now=max(ended_at, timezone.now()))
    if report.accepted:
        from gateway.services import charge

        row = LedgerEvent.objects.get(event_id=event.event_id)
        charge(user_id=str(row.user_id), project_id=str(row.project_id) if row.project_id else None,
               cost_nano_usd=row.cost_nano_usd, at=row.ended_at)  # fmt: skip
    return report


def _segment_prefix(task_id: object) -> str:
    """A task's GPU segments are named gpu:<task id>:<the segment's start>."""
    return f"gpu:{task_id}:"


def task_gpu_usage(*, task_id: Any, user_id: Any, since: datetime) -> dict[str, Any] | None:
    """The GPU time (units x milliseconds) and cost (nano-USD) the ledger holds for a task's runs, or None
    before any. Read through the ledger's (user, started_at) index: the submitter's events since the task
    was submitted, not the whole ledger."""
    from apps.metering.ledger import amount_sums

    sums = LedgerEvent.objects.filter(
        user_id=user_id, started_at__gte=since, kind=Kind.GPU, event_id__startswith=_segment_prefix(task_id)
    ).aggregate(**amount_sums())
    return None if sums["gpu_unit_ms"] is None else sums


def compute_cost(*, since: datetime, project_id: Any = None, user_id: Any = None) -> int:
    """The GPU and storage cost (nano-USD) metered since `since` for a project, a user, or everyone."""
    from django.db.models import Sum

    events = LedgerEvent.objects.filter(kind__in=(Kind.GPU, Kind.STORAGE), ended_at__gte=since)
    if project_id is not None:
        events = events.filter(project_id=project_id)
    if user_id is not None:
        events = events.filter(user_id=user_id)
    return int(events.aggregate(cost=Sum("cost_nano_usd"))["cost"] or 0)


def gateway_calls() -> Report:
    """Move the gateway's metered calls into the ledger (each call's request id is its event id), up to
    5,000 a run; the ones already there, or refused before, are skipped."""
    from gateway.models import Usage

    pending = (
        Usage.objects.exclude(status=Usage.Status.FAILED)
        .exclude(request_id__in=LedgerEvent.objects.filter(kind=Kind.TOKENS).values("event_id"))
        .exclude(request_id__in=Rejection.objects.values("event_id"))
        .order_by("at")[:5000]
    )
    events = [
        Event(
            event_id=row.request_id,
            kind=Kind.TOKENS,
            started_at=row.at,
            user=str(row.user_id),
            project=str(row.project_id) if row.project_id else "",
            model=row.model,
            tokens_in=row.tokens_in,
            tokens_out=row.tokens_out,
            cost_nano_usd=row.cost_nano_usd,
            source="gateway",
        )
        for row in pending
    ]
    return ingest(events) if events else Report()


def storage(*, now: datetime | None = None, hours: int = 3) -> Report:
    """Meter task outputs kept over the last `hours` whole hours: bytes x time, one event per output and
    hour (so a rerun of this after a missed hour still meters it, once)."""
    from apps.fleet.models import TaskOutput

    now = now or timezone.now()
    end = now.replace(minute=0, second=0, microsecond=0)
    events = []
    outputs = TaskOutput.objects.select_related("task", "task__project", "task__submitter").filter(at__lt=end)
    for output in outputs:
        for hour in range(hours, 0, -1):
            window_start, window_end = end - timedelta(hours=hour), end - timedelta(hours=hour - 1)
            start = max(window_start, output.at)
            if start >= window_end:
                continue
            task = output.task
            events.append(
                Event(
                    event_id=f"storage:{output.pk}:{window_start:%Y%m%d%H}",
                    kind=Kind.STORAGE,
                    started_at=start,
                    ended_at=window_end,
                    user=task.submitter.username,
                    project=task.project.name if task.project else "",
                    bytes=output.size,
                    source="storage",
                )
            )
    return ingest(events, now=now) if events else Report()


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


def price_book() -> PriceBook:
    return PriceBook.objects.filter(pk=1).first() or PriceBook(pk=1)


MAX_PRICE = Decimal(1_000_000)  # USD per unit: more is a typo, and would overflow what it prices


def check_price(value: Any, where: str) -> str:
    """A price in USD as text, or InvalidInput saying what a price may be: 0 to 1,000,000, at most six
    decimal places (what the ledger's nano-USD and Stripe's cents can carry)."""
    try:
        price = Decimal(str(value)) if not isinstance(value, bool) else Decimal("NaN")
    except ArithmeticError:
        price = Decimal("NaN")
    exponent = price.as_tuple().exponent
    if not price.is_finite() or not 0 <= price <= MAX_PRICE or (isinstance(exponent, int) and exponent < -6):
        raise InvalidInput(
            f"{where}: a price in USD from 0 to {MAX_PRICE:,}, with at most six decimals, as 2.50 "
            f"(got {str(value)[:40]!r}).",
            field=where,
        )
    return str(price)


def checked_prices(
    gpu_hour: dict[str, Any], tokens_million: dict[str, Any]
) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """A price book's GPU-hour and token prices, each checked (check_price), or InvalidInput naming one."""
    if len(gpu_hour) > 500 or len(tokens_million) > 500:
        raise InvalidInput("A price book holds at most 500 GPU classes and 500 models.")
    checked_gpu = {str(name)[:50]: check_price(price, f"gpu_hour.{name}") for name, price in gpu_hour.items()}
    checked_tokens = {}
    for model, prices in tokens_million.items():
        if not isinstance(prices, dict) or set(prices) - {"in", "out"}:
            raise InvalidInput(f'tokens_million.{model}: {{"in": <USD>, "out": <USD>}} per million tokens.')
        checked_tokens[str(model)[:100]] = {
            side: check_price(prices.get(side, 0), f"tokens_million.{model}.{side}") for side in ("in", "out")
        }
    return checked_gpu, checked_tokens


@transaction.atomic
def price_book_save(*, gpu_hour: dict[str, Any], tokens_million: dict[str, Any], gb_month: Any) -> PriceBook:
    """Set the tenant's prices. They price events as they are recorded; what is recorded keeps its price."""
    checked_gpu, checked_tokens = checked_prices(gpu_hour, tokens_million)
    book, _ = PriceBook.objects.update_or_create(
        pk=1,
        defaults={
            "gpu_hour": checked_gpu,
            "tokens_million": checked_tokens,
            "gb_month": Decimal(check_price(gb_month, "gb_month")),
        },
    )
    return book


def _event(item: Any) -> Event:
    if not isinstance(item, dict):
        raise TypeError("expected an object")
    return Event.from_dict(item)


def import_events(items: list[Any]) -> Report:
    """Events sent through the API (an admin's import); each bad one is refused with its reason."""
    events, refused = [], []
    for index, item in enumerate(items):
        try:
            events.append(_event(item))
        except (ValueError, TypeError) as error:
            event_id = str(item.get("event_id", f"#{index}")) if isinstance(item, dict) else f"#{index}"
            refused.append((event_id, str(error)))
            Rejection.objects.create(event_id=event_id, reason=str(error), payload={"raw": repr(item)[:2000]})
    report = ingest(events)
    report.rejected = refused + report.rejected
    return report


def rejections() -> QuerySet[Rejection]:
    return Rejection.objects.all()


def names(column: str) -> dict[str, str]:
    """Names for the ids a summary groups by (projects and users), so it reads as people do."""
    from apps.accounts.models import Project

    if column == "project_id":
        return {str(pk): name for pk, name in Project.objects.values_list("pk", "name")}
    if column == "user_id":
        return {str(pk): name for pk, name in User.objects.values_list("pk", "username")}
    return {}


def period_of(text: str) -> date:
    """A period named as 2026-11."""
    try:
        return datetime.strptime(text, "%Y-%m").date()
    except ValueError:
        raise InvalidInput(f"A period is a month, as 2026-11 (got {text!r}).", field="period") from None


@transaction.atomic
def period_close(*, start: date) -> Period:
    """Close a month: events that arrive for it later land, marked late, in the next open month."""
    period, _ = Period.objects.select_for_update().get_or_create(start=start)
    if period.closed_at is not None:
        raise InvalidInput(f"{start:%Y-%m} was closed on {period.closed_at:%Y-%m-%d %H:%M} UTC already.")
    if start >= timezone.now().date().replace(day=1):
        raise InvalidInput(f"{start:%Y-%m} has not ended yet; close a month once it is over.")
    period.closed_at = timezone.now()
    period.save(update_fields=["closed_at"])
    return period


def periods() -> QuerySet[Period]:
    return Period.objects.all()
