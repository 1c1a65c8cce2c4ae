"""Usage into Stripe: a customer per tenant, a push per tenant, month and kind, and a reconciliation.

`export_period` computes each tenant's month from its ledger (by the ledger's own periods, so late events
count where they landed), priced with the provider's price book (never the tenant's, which prices its
internal chargeback), and records one pending push per kind. `push_pending` sends them: as billing
meter events (`klique_gpu_hours`, `klique_tokens`, `klique_storage_gb_hours`, with the push's key as the
event's identifier) or, where meters are not used, as invoice items in USD cents; each request carries
the push's idempotency key. While Stripe cannot be reached, a push stays pending and is retried (Celery
beat); nothing is lost and nothing is sent twice. `reconcile` lists what Stripe holds per tenant against
what the ledger says.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_tenants.utils import get_public_schema_name, schema_context

from apps.billing.models import ProviderPriceBook, StripeCustomer, StripePush
from apps.core.errors import InvalidInput
from apps.metering.ledger import amount_sums, gb_hours, gpu_hours
from apps.metering.models import LedgerEvent
from apps.metering.services import check_price, checked_prices
from tenants.models import Tenant

log = logging.getLogger("klique.billing")

METERS = {"gpu": "klique_gpu_hours", "tokens": "klique_tokens", "storage": "klique_storage_gb_hours"}
# Stripe takes a meter event only while its timestamp is within the past 35 calendar days.
METER_EVENT_MAX_AGE = timedelta(days=35)


class StripeUnavailable(Exception):
    pass


class TooLateForMeterEvents(Exception):
    """A month whose last second is past Stripe's meter event window: Stripe would refuse it."""


def _meter_event_time(period: date) -> datetime:
    """A month's meter events are stamped with its last second, so they count in that month."""
    month_end = (period + timedelta(days=32)).replace(day=1)
    return datetime.combine(month_end, datetime.min.time(), tzinfo=UTC) - timedelta(seconds=1)


def _check_meter_event_window(period: date) -> None:
    stamped = _meter_event_time(period)
    if timezone.now() - stamped > METER_EVENT_MAX_AGE:
        raise TooLateForMeterEvents(
            f"Stripe takes meter events from the past {METER_EVENT_MAX_AGE.days} days only, and "
            f"{period:%Y-%m} ended on {stamped:%Y-%m-%d}: bill it as invoice items "
            "(KLIQUE_STRIPE_MODE=invoice_items) or in Stripe by hand."
        )


def client() -> Any:
    import stripe  # noqa: PLC0415 -- 0.4 s to import; only billing exports use it

    key = settings.KLIQUE_STRIPE_API_KEY
    if not key:
        raise StripeUnavailable(
            "Stripe is not configured: set KLIQUE_STRIPE_API_KEY (and KLIQUE_STRIPE_API_BASE)."
        )
    addresses: Any = {"api": settings.KLIQUE_STRIPE_API_BASE} if settings.KLIQUE_STRIPE_API_BASE else {}
    return stripe.StripeClient(key, base_addresses=addresses, max_network_retries=0)


def provider_prices() -> ProviderPriceBook:
    with schema_context(get_public_schema_name()):
        return ProviderPriceBook.objects.filter(pk=1).first() or ProviderPriceBook(pk=1)


@transaction.atomic
def provider_prices_save(
    *, gpu_hour: dict[str, Any], tokens_million: dict[str, Any], gb_month: Any
) -> ProviderPriceBook:
    """Set what the provider charges its tenants (each price checked as a tenant's book checks its own)."""

    checked_gpu, checked_tokens = checked_prices(gpu_hour, tokens_million)
    with schema_context(get_public_schema_name()):
        book, _ = ProviderPriceBook.objects.update_or_create(
            pk=1,
            defaults={
                "gpu_hour": checked_gpu,
                "tokens_million": checked_tokens,
                "gb_month": None if gb_month is None else Decimal(check_price(gb_month, "gb_month")),
            },
        )
    return book


class Unpriced(Exception):
    """Usage the provider's price book has no price for; the message names what to price."""


def _provider_amount(book: ProviderPriceBook, row: dict[str, Any]) -> Decimal | None:
    """What one row of a tenant's month costs at the provider's prices, in USD; None where unpriced."""

    if row["kind"] == "gpu":
        price = book.gpu_hour.get(row["gpu_class"] or "", book.gpu_hour.get("*"))
        return None if price is None else gpu_hours(row["gpu_unit_ms"]) * Decimal(price)
    if row["kind"] == "tokens":
        prices = book.tokens_million.get(row["model"] or "", book.tokens_million.get("*"))
        if prices is None:
            return None
        tokens_in, tokens_out = Decimal(row["tokens_in"]), Decimal(row["tokens_out"])
        return (tokens_in * Decimal(prices["in"]) + tokens_out * Decimal(prices["out"])) / 10**6
    if book.gb_month is None:
        return None
    return gb_hours(row["byte_ms"]) / 720 * book.gb_month  # a GB-month is 30 days of a GB


def _what(row: dict[str, Any]) -> str:
    if row["kind"] == "gpu":
        return f"GPU class {row['gpu_class'] or '(none)'} (gpu_hour)"
    if row["kind"] == "tokens":
        return f"model {row['model'] or '(none)'} (tokens_million)"
    return "storage (gb_month)"


def _month_totals(schema: str, period: date, *, priced: bool = True) -> dict[str, dict[str, Decimal]]:
    """A tenant's month per kind: the quantity, and what it comes to at the provider's prices (never the
    tenant's own book). `priced`: every row must have a provider price, else Unpriced names them."""

    book = provider_prices()
    with schema_context(schema):
        rows: Iterable[Any] = (  # rows of .values(), with the sums annotated
            LedgerEvent.objects.filter(period=period)
            .values("kind", "gpu_class", "model")
            .annotate(**amount_sums())
            .order_by("kind", "gpu_class", "model")
        )
        rows = list(rows)
    totals: dict[str, dict[str, Decimal]] = {}
    unpriced: list[str] = []
    for row in rows:
        quantity = {
            "gpu": gpu_hours(row["gpu_unit_ms"]),
            "tokens": Decimal(row["tokens_in"] + row["tokens_out"]),
            "storage": gb_hours(row["byte_ms"]),
        }[row["kind"]]
        amount = _provider_amount(book, row)
        if amount is None:
            unpriced.append(_what(row))
        total = totals.setdefault(row["kind"], {"quantity": Decimal(0), "usd": Decimal(0)})
        total["quantity"] += quantity
        total["usd"] += amount or 0
    if unpriced and priced:
        raise Unpriced(
            f"The provider's price book has no price for {', '.join(sorted(set(unpriced)))} used by "
            f'tenant {schema}: set it with PUT /api/v1/provider/billing/prices/ (a "*" price covers the '
            "rest) before invoicing."
        )
    return {
        kind: {
            "quantity": total["quantity"].quantize(Decimal("0.000001")),
            "cents": (total["usd"] * 100).quantize(Decimal(1), rounding=ROUND_HALF_UP),
        }
        for kind, total in totals.items()
    }


@transaction.atomic
def export_period(period: date) -> list[StripePush]:
    """Record each tenant's usage of `period` as pushes (once; a second export changes nothing)."""
    if period >= timezone.now().date().replace(day=1):
        raise InvalidInput(f"{period:%Y-%m} is not over yet; export a month once it has ended.")
    mode = (
        StripePush.Mode.METER_EVENT
        if settings.KLIQUE_STRIPE_MODE == "meter_events"
        else StripePush.Mode.INVOICE_ITEM
    )
    if mode == StripePush.Mode.METER_EVENT:
        try:
            _check_meter_event_window(period)
        except TooLateForMeterEvents as late:
            raise InvalidInput(str(late), field="period") from None
    pushes = []
    with schema_context(get_public_schema_name()):
        tenants = list(Tenant.objects.exclude(schema_name=get_public_schema_name()))
    invoiced = mode == StripePush.Mode.INVOICE_ITEM  # meter events are priced by Stripe's own prices
    try:
        months = {tenant.pk: _month_totals(tenant.schema_name, period, priced=invoiced) for tenant in tenants}
    except Unpriced as unpriced:
        raise InvalidInput(str(unpriced), field="period") from None
    for tenant in tenants:
        for kind, total in sorted(months[tenant.pk].items()):
            push, _ = StripePush.objects.get_or_create(
                tenant=tenant,
                period=period,
                kind=kind,
                defaults={
                    "quantity": total["quantity"],
                    "amount_cents": int(total["cents"]),
                    "idempotency_key": f"klique-{tenant.slug}-{period:%Y-%m}-{kind}",
                    "mode": mode,
                },
            )
            pushes.append(push)
    return pushes


def _customer(stripe: Any, tenant: Tenant) -> str:
    known = StripeCustomer.objects.filter(tenant=tenant).first()
    if known is not None:
        return known.customer_id
    customer = stripe.v1.customers.create(
        params={"name": tenant.name, "metadata": {"klique_tenant": tenant.slug}},
        options={"idempotency_key": f"klique-customer-{tenant.slug}"},
    )
    StripeCustomer.objects.create(tenant=tenant, customer_id=customer.id)
    return str(customer.id)


def _send(stripe: Any, push: StripePush, customer: str) -> str:
    if push.mode == StripePush.Mode.METER_EVENT:
        _check_meter_event_window(push.period)  # a push left pending that long (an outage) goes no further
        event = stripe.v1.billing.meter_events.create(
            params={
                "event_name": METERS[push.kind],
                "payload": {"stripe_customer_id": customer, "value": str(push.quantity)},
                "identifier": push.idempotency_key,
                "timestamp": int(_meter_event_time(push.period).timestamp()),
            },
            options={"idempotency_key": push.idempotency_key},
        )
        return str(event.identifier)
    item = stripe.v1.invoice_items.create(
        params={
            "customer": customer,
            "amount": push.amount_cents,
            "currency": "usd",
            "description": f"Klique {push.kind} {push.period:%Y-%m}: {push.quantity}",
            "metadata": {"klique_period": f"{push.period:%Y-%m}", "klique_kind": push.kind},
        },
        options={"idempotency_key": push.idempotency_key},
    )
    return str(item.id)


def push_pending() -> dict[str, int]:
    """Send every pending push; those Stripe could not take stay pending for the next run."""
    import stripe as library  # noqa: PLC0415 -- 0.4 s to import; only billing exports use it

    counts = {"sent": 0, "pending": 0, "failed": 0}
    stripe = client()
    for push in StripePush.objects.select_related("tenant").filter(status=StripePush.Status.PENDING):
        push.attempts += 1
        try:
            push.stripe_id = _send(stripe, push, _customer(stripe, push.tenant))
            push.status, push.sent_at, push.last_error = StripePush.Status.SENT, timezone.now(), ""
        except TooLateForMeterEvents as late:
            push.status, push.last_error = StripePush.Status.FAILED, str(late)
        except (library.APIConnectionError, library.RateLimitError) as error:
            push.last_error = f"Stripe could not be reached ({error.user_message or error}); retrying"
        except library.StripeError as error:
            if (error.http_status or 500) >= 500:
                push.last_error = f"Stripe failed ({error.http_status}); retrying"
            else:
                push.status, push.last_error = (
                    StripePush.Status.FAILED,
                    f"Stripe refused it: {error.user_message or error}",
                )
        push.save()
        counts[push.status] += 1
    return counts


@dataclass(frozen=True)
class Reconciled:
    tenant: str
    kind: str
    ledger_cents: int
    stripe_cents: int | None  # None: Stripe holds nothing for it (or, for meter events, nothing was sent)
    source: str = "invoice items"  # what stripe_cents was read from

    @property
    def state(self) -> str:
        if self.stripe_cents is None:
            return "missing"
        return "match" if self.stripe_cents == self.ledger_cents else "differs"


def reconcile(period: date) -> list[Reconciled]:
    """What Stripe holds for `period` beside what each tenant's ledger says. Invoice items are read back
    from Stripe (by their metadata). Meter events cannot be listed back one by one (Stripe only sums them
    per meter), so for those the report shows what was sent and acknowledged, marked as such."""
    stripe = client()  # configured or refused, whichever way usage went in
    meters = settings.KLIQUE_STRIPE_MODE == "meter_events"
    rows = []
    with schema_context(get_public_schema_name()):
        tenants = list(Tenant.objects.exclude(schema_name=get_public_schema_name()))
    for tenant in tenants:
        month = _month_totals(tenant.schema_name, period, priced=False)
        ledger = {kind: int(total["cents"]) for kind, total in month.items()}
        if meters:
            sent = StripePush.objects.filter(tenant=tenant, period=period, status=StripePush.Status.SENT)
            held = {push.kind: push.amount_cents for push in sent}
            source = "meter events acknowledged"
        else:
            held = _invoice_items(stripe, tenant, period)
            source = "invoice items"
        for kind in sorted(set(ledger) | set(held)):
            rows.append(Reconciled(tenant.slug, kind, ledger.get(kind, 0), held.get(kind), source))
    return rows


def _invoice_items(stripe: Any, tenant: Tenant, period: date) -> dict[str, int]:
    held: dict[str, int] = {}
    customer = StripeCustomer.objects.filter(tenant=tenant).first()
    if customer is None:
        return held
    items = stripe.v1.invoice_items.list(params={"customer": customer.customer_id, "limit": 100})
    for item in items.auto_paging_iter():
        metadata = item.metadata.to_dict() if item.metadata else {}
        if metadata.get("klique_period") == f"{period:%Y-%m}":
            kind = metadata.get("klique_kind", "")
            held[kind] = held.get(kind, 0) + int(item.amount)
    return held
