"""The ledger's writers for administrators: imports, the price book and closing a period; and the cloud
instances' time, which fleet reports. The apps whose usage it is write their own events (the gateway its
calls, fleet its outputs, scheduling its runs through runs.py); what is read is in selectors.py."""

from __future__ import annotations

import logging
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.utils import timezone

from apps.core.errors import InvalidInput
from apps.metering.ledger import Event, Report, ingest
from apps.metering.models import Kind, Period, PriceBook, Rejection

logger = logging.getLogger(__name__)

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
def price_book_save(
    *, gpu_hour: dict[str, Any], tokens_million: dict[str, Any], gb_month: Any,
    instance_hour: dict[str, Any] | None = None,
) -> PriceBook:  # fmt: skip
    """Set the tenant's prices. They price events as they are recorded; what is recorded keeps its price."""
    checked_gpu, checked_tokens = checked_prices(gpu_hour, tokens_million)
    instance_hour = instance_hour or {}
    if len(instance_hour) > 500:
        raise InvalidInput("A price book holds at most 500 instance types.")
    checked_instances = {
        str(name)[:100]: check_price(price, f"instance_hour.{name}") for name, price in instance_hour.items()
    }
    book, _ = PriceBook.objects.update_or_create(
        pk=1,
        defaults={
            "gpu_hour": checked_gpu,
            "tokens_million": checked_tokens,
            "gb_month": Decimal(check_price(gb_month, "gb_month")),
            "instance_hour": checked_instances,
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


def instance_segment(
    *, name: str, instance_type: str, pool_id: str, busy: bool, started_at: datetime, ended_at: datetime
) -> Report:
    """Meter one stretch of a cloud instance's life in its pool at its type's price: as `instance` while it
    ran work, as `idle` otherwise (booting, idle, being ended). Named by the instance and the stretch's
    start, so writing it twice counts once. No one's wallet pays it: it is the pool's cost, in chargeback."""
    event = Event(
        event_id=f"instance:{name}:{started_at.isoformat()}",
        kind=Kind.INSTANCE if busy else Kind.IDLE,
        started_at=started_at,
        ended_at=max(ended_at, started_at),
        pool=pool_id,
        instance_type=instance_type or "unknown",
        source="autoscaler",
    )
    report = ingest([event], now=max(ended_at, timezone.now()))
    if report.rejected:
        logger.warning("instance %s: its time was not metered: %s", name, report.rejected)
    return report
