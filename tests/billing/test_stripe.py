"""Usage into Stripe, against localstripe (a local Stripe API) with the real stripe library: customers,
invoice items with idempotency keys, an outage that loses nothing, a reconciliation; and a contract test of
the billing meter event request the library sends (localstripe has no meters)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import httpx
import pytest
from django.test import override_settings
from django_tenants.utils import schema_context

from apps.billing import services
from apps.billing.models import StripeCustomer, StripePush
from apps.metering.ledger import Event, ingest
from apps.metering.models import PriceBook
from tests.e2e.conftest import free_port
from tests.world import World

pytestmark = pytest.mark.django_db

THIS_MONTH = datetime.now(UTC).date().replace(day=1)
LAST_MONTH = (THIS_MONTH - timedelta(days=1)).replace(day=1)  # Stripe takes meter events for 35 days
LONG_AGO = (THIS_MONTH - timedelta(days=70)).replace(day=1)  # ended 39 days or more before this month


@pytest.fixture(scope="module")
def localstripe() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "localstripe", "--port", str(port), "--from-scratch"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(f"{base}/v1/customers", auth=("sk_test_klique", ""), timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def last_month_usage(world: World) -> World:
    services.provider_prices_save(  # what the provider invoices; the tenant's book below is its chargeback's
        gpu_hour={"H100": "2.50"}, tokens_million={"*": {"in": "1", "out": "2"}}, gb_month=None
    )
    with schema_context("acme"):
        PriceBook.objects.update_or_create(
            pk=1, defaults={"gpu_hour": {"H100": "2.50"}, "tokens_million": {"chat": {"in": "1", "out": "2"}}}
        )
        started = datetime.combine(LAST_MONTH + timedelta(days=11), datetime.min.time(), tzinfo=UTC).replace(
            hour=8
        )
        ingest(
            [
                Event(
                    event_id="last-month-run",
                    kind="gpu",
                    started_at=started,
                    ended_at=started.replace(hour=12),
                    user="bob",
                    pool="h100",
                    gpus="1/7",
                ),
                Event(
                    event_id="last-month-call",
                    kind="tokens",
                    started_at=started,
                    user="bob",
                    model="chat",
                    tokens_in=3_000_000,
                    tokens_out=1_000_000,
                ),
            ]
        )
    return world


def stripe_settings(base: str, mode: str = "invoice_items") -> Any:
    return override_settings(
        KLIQUE_STRIPE_API_KEY="sk_test_klique", KLIQUE_STRIPE_API_BASE=base, KLIQUE_STRIPE_MODE=mode
    )


def test_a_month_goes_to_stripe_once_and_reconciles(last_month_usage: World, localstripe: str) -> None:
    with stripe_settings(localstripe):
        pushes = services.export_period(LAST_MONTH)
        assert {(p.tenant.slug, p.kind, p.amount_cents) for p in pushes} == {
            ("acme", "gpu", 143),  # 4/7 GPU-hours at 2.50: 1.428571... USD
            ("acme", "tokens", 500),  # 3M in at 1 and 1M out at 2 per million
        }
        assert services.push_pending() == {"sent": 2, "pending": 0, "failed": 0}
        customer = StripeCustomer.objects.get(tenant=last_month_usage.tenant_a)
        assert customer.customer_id.startswith("cus_")
        # Exporting and pushing again sends nothing twice.
        services.export_period(LAST_MONTH)
        assert services.push_pending() == {"sent": 0, "pending": 0, "failed": 0}
        rows = services.reconcile(LAST_MONTH)
        assert {(r.tenant, r.kind, r.ledger_cents, r.stripe_cents, r.state) for r in rows} == {
            ("acme", "gpu", 143, 143, "match"),
            ("acme", "tokens", 500, 500, "match"),
        }


def test_a_stripe_outage_keeps_the_pushes_and_a_retry_sends_them(
    last_month_usage: World, localstripe: str
) -> None:
    with stripe_settings(f"http://127.0.0.1:{free_port()}"):  # nothing listens there
        services.export_period(LAST_MONTH)
        assert services.push_pending() == {"sent": 0, "pending": 2, "failed": 0}
        stuck = StripePush.objects.get(kind="gpu")
        assert (stuck.status, stuck.attempts) == ("pending", 1)
        assert "Stripe could not be reached" in stuck.last_error
    with stripe_settings(localstripe):
        assert services.push_pending() == {"sent": 2, "pending": 0, "failed": 0}
        assert [r.state for r in services.reconcile(LAST_MONTH)] == ["match", "match"]
        assert StripePush.objects.get(kind="gpu").attempts == 2


def test_what_stripe_refuses_is_marked_failed_with_its_reason(
    last_month_usage: World, localstripe: str
) -> None:
    with stripe_settings(localstripe, mode="meter_events"):  # localstripe has no billing meters
        services.export_period(LAST_MONTH)
        assert services.push_pending()["failed"] == 2
        assert StripePush.objects.get(kind="tokens").last_error.startswith("Stripe refused it")


def test_an_unfinished_month_is_not_exported(world: World) -> None:
    from apps.core.errors import InvalidInput

    with pytest.raises(InvalidInput, match="is not over yet"):
        services.export_period(datetime.now(UTC).date().replace(day=1))


class Recorder(BaseHTTPRequestHandler):
    requests: list[dict[str, Any]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        Recorder.requests.append(
            {"path": self.path, "headers": dict(self.headers), "form": urllib.parse.parse_qs(body)}
        )
        answer: dict[str, Any] = {"id": "cus_contract", "object": "customer"}
        if self.path != "/v1/customers":
            form = urllib.parse.parse_qs(body)
            answer = {
                "object": "billing.meter_event",
                "event_name": form["event_name"][0],
                "identifier": form["identifier"][0],
                "livemode": False,
            }
        payload = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recording_stripe() -> Iterator[str]:
    """A local server that records each request and answers as Stripe would (customers, meter events)."""
    server = HTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Recorder.requests = []
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def test_the_meter_event_request_the_library_sends(last_month_usage: World, recording_stripe: str) -> None:
    """The request stripe-python sends for a meter event, as Stripe's API reference describes it."""
    with stripe_settings(recording_stripe, mode="meter_events"):
        services.export_period(LAST_MONTH)
        assert services.push_pending() == {"sent": 2, "pending": 0, "failed": 0}
    customer, *events = Recorder.requests
    assert customer["path"] == "/v1/customers"
    assert customer["headers"]["Idempotency-Key"] == "klique-customer-acme"
    gpu = next(e for e in events if e["form"]["event_name"] == ["klique_gpu_hours"])
    assert gpu["path"] == "/v1/billing/meter_events"
    assert gpu["headers"]["Authorization"] == "Bearer sk_test_klique"
    assert gpu["headers"]["Idempotency-Key"] == f"klique-acme-{LAST_MONTH:%Y-%m}-gpu"
    assert gpu["form"]["payload[stripe_customer_id]"] == ["cus_contract"]
    assert gpu["form"]["payload[value]"] == ["0.571429"]  # GPU-hours, as a decimal string
    assert gpu["form"]["identifier"] == [f"klique-acme-{LAST_MONTH:%Y-%m}-gpu"]
    last_second = datetime.combine(THIS_MONTH, datetime.min.time(), tzinfo=UTC) - timedelta(seconds=1)
    assert gpu["form"]["timestamp"] == [str(int(last_second.timestamp()))]  # the month's last second
    assert StripePush.objects.get(kind="gpu").stripe_id == f"klique-acme-{LAST_MONTH:%Y-%m}-gpu"


def test_meter_events_are_reconciled_by_what_stripe_acknowledged(
    last_month_usage: World, recording_stripe: str
) -> None:
    with stripe_settings(recording_stripe, mode="meter_events"):
        services.export_period(LAST_MONTH)
        services.push_pending()
        rows = services.reconcile(LAST_MONTH)
    assert {(r.kind, r.state, r.source) for r in rows} == {
        ("gpu", "match", "meter events acknowledged"),
        ("tokens", "match", "meter events acknowledged"),
    }


def test_a_month_past_stripes_meter_event_window_is_refused_with_what_to_do(world: World) -> None:
    from apps.core.errors import InvalidInput

    with override_settings(KLIQUE_STRIPE_MODE="meter_events"), pytest.raises(InvalidInput) as refused:
        services.export_period(LONG_AGO)
    assert "from the past 35 days only" in refused.value.message
    assert "KLIQUE_STRIPE_MODE=invoice_items" in refused.value.message
    assert not StripePush.objects.filter(period=LONG_AGO).exists()


def test_a_meter_event_push_left_pending_past_the_window_fails_without_a_request(
    last_month_usage: World, recording_stripe: str
) -> None:
    """Say Stripe was out until the window closed: the push fails with the reason; nothing is sent."""
    with stripe_settings(recording_stripe, mode="meter_events"):
        services.export_period(LAST_MONTH)
        StripePush.objects.filter(kind="gpu").update(period=LONG_AGO)
        assert services.push_pending() == {"sent": 1, "pending": 0, "failed": 1}
    failed = StripePush.objects.get(kind="gpu")
    assert (failed.status, failed.stripe_id) == (StripePush.Status.FAILED, "")
    assert failed.last_error.startswith("Stripe takes meter events from the past 35 days only")
    assert [r["form"]["event_name"] for r in Recorder.requests if r["path"] != "/v1/customers"] == [
        ["klique_tokens"]
    ]


@pytest.mark.parametrize(
    "tenant_book",
    [
        {"gpu_hour": {}, "tokens_million": {}},  # an empty book used to invoice 0
        {"gpu_hour": {"H100": "0"}, "tokens_million": {"chat": {"in": "0", "out": "0"}}},
        {"gpu_hour": {"H100": "999"}, "tokens_million": {"chat": {"in": "999", "out": "999"}}},
    ],
)
def test_the_provider_invoices_at_its_own_prices_whatever_the_tenants_book_says(
    last_month_usage: World, localstripe: str, tenant_book: dict[str, Any]
) -> None:
    with schema_context("acme"):
        PriceBook.objects.filter(pk=1).update(**tenant_book)
    with stripe_settings(localstripe):
        pushes = services.export_period(LAST_MONTH)
        assert {(p.kind, p.amount_cents) for p in pushes} == {("gpu", 143), ("tokens", 500)}
        services.push_pending()
        assert {(r.kind, r.stripe_cents, r.state) for r in services.reconcile(LAST_MONTH)} == {
            ("gpu", 143, "match"),
            ("tokens", 500, "match"),
        }


def test_invoicing_usage_the_provider_has_no_price_for_is_refused_with_what_to_price(
    last_month_usage: World, localstripe: str
) -> None:
    from apps.core.errors import InvalidInput

    services.provider_prices_save(gpu_hour={"A100": "1.00"}, tokens_million={}, gb_month=None)
    with stripe_settings(localstripe), pytest.raises(InvalidInput) as refused:
        services.export_period(LAST_MONTH)
    assert "no price for GPU class H100 (gpu_hour), model chat (tokens_million)" in refused.value.message
    assert not StripePush.objects.exists()


@pytest.mark.parametrize("price", ["1E+400", "-1", "NaN", "Infinity", "abc", True, "0.0000001", "1000001"])
def test_provider_prices_are_bounded(price: Any, api: Any) -> None:
    answer = api("root").put("/api/v1/provider/billing/prices/", {"gpu_hour": {"H100": price}}, format="json")
    assert answer.status_code == 400, answer.content
    assert "a price in USD from 0 to 1,000,000" in answer.json()["detail"]
    assert api("root").get("/api/v1/provider/billing/prices/").json()["gpu_hour"] == {}
