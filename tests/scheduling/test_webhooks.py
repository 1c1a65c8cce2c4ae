"""Webhooks: a queue-wait objective's change of state sent to a tenant's endpoint (a real HTTP server
here), signed with the tenant secret it names, retried with backoff until answered, logged; and the
addresses Klique refuses to call."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from apps.scheduling import objectives, webhooks
from apps.scheduling.models import EventWebhook, WebhookDelivery
from tests.scheduling.test_objectives import HOUR, acme, record  # noqa: F401 -- acme is a fixture
from tests.world import SECRET_VALUE_A, World


class Endpoint(BaseHTTPRequestHandler):
    answers: list[int] = []  # one status per request, then 200
    received: list[dict[str, Any]] = []
    delay = 0.0  # seconds before each answer

    def do_POST(self) -> None:
        time.sleep(Endpoint.delay)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Endpoint.received.append({"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
        self.send_response(Endpoint.answers.pop(0) if Endpoint.answers else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    Endpoint.answers, Endpoint.received, Endpoint.delay = [], [], 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/klique-events"
    server.shutdown()


def only_webhook(endpoint: str, kinds: tuple[str, ...] | list[str] = ("slo.breached",)) -> None:
    """The tenant's one webhook: to `endpoint`, for `kinds`."""
    EventWebhook.objects.all().delete()
    webhooks.webhook_save(url=endpoint, secret_name="SHARED_TOKEN", kinds=list(kinds), actor="alice")


def breach(world: World) -> None:
    now = timezone.now()
    record([600.0] * 37 + [2 * HOUR] * 3, now=now)
    objectives.objectives_evaluate(tenant=world.tenant_a, now=now)


def test_an_announcement_is_signed_retried_until_answered_and_sent_once(
    acme: None,  # noqa: F811
    world: World,
    api: Callable[..., APIClient],
    endpoint: str,
) -> None:
    EventWebhook.objects.all().delete()
    made = api("alice").post(
        "/api/v1/webhooks/", {"url": endpoint, "secret_name": "SHARED_TOKEN"}, format="json"
    )
    assert made.status_code == 201, made.content
    Endpoint.answers = [503]
    breach(world)
    now = timezone.now()
    assert webhooks.deliver_due(now=now) == 0  # answered 503: kept for a retry
    assert webhooks.deliver_due(now=now + timedelta(seconds=10)) == 0  # not due yet: nothing sent
    assert len(Endpoint.received) == 1
    assert webhooks.deliver_due(now=now + timedelta(seconds=31)) == 1
    assert webhooks.deliver_due(now=now + timedelta(hours=2)) == 0  # delivered: never again
    assert len(Endpoint.received) == 2
    first, second = Endpoint.received
    assert first["headers"]["x-klique-delivery"] == second["headers"]["x-klique-delivery"]  # the same one
    for request in (first, second):
        headers = request["headers"]
        expected = hmac.new(
            SECRET_VALUE_A.encode(),
            headers["x-klique-timestamp"].encode() + b"." + request["body"],
            hashlib.sha256,
        ).hexdigest()
        assert headers["x-klique-signature"] == f"sha256={expected}"
        assert headers["x-klique-event"] == "slo.breached"
    body = json.loads(second["body"])
    assert (body["kind"], body["objective"], body["tasks_over_target"]) == ("slo.breached", "research-p95", 3)
    log = api("alice").get(f"/api/v1/webhooks/{made.json()['id']}/deliveries/").json()["results"]
    assert [(row["status"], row["attempts"], row["last_error"]) for row in log] == [("delivered", 2, "")]


def test_an_endpoint_that_never_answers_well_is_given_up_on_with_its_last_error(
    acme: None,  # noqa: F811
    world: World,
    endpoint: str,
) -> None:
    only_webhook(endpoint)
    Endpoint.answers = [500] * 20
    breach(world)
    moment = timezone.now()
    for _ in range(webhooks.MAX_ATTEMPTS + 2):
        webhooks.deliver_due(now=moment)
        moment += timedelta(hours=2)
    delivery = WebhookDelivery.objects.get()
    assert (delivery.status, delivery.attempts) == ("failed", webhooks.MAX_ATTEMPTS)
    assert delivery.last_error == "the endpoint answered 500"
    assert len(Endpoint.received) == webhooks.MAX_ATTEMPTS


def test_deliveries_are_sent_side_by_side_each_once(
    acme: None,  # noqa: F811
    world: World,
    endpoint: str,
) -> None:
    """A slow endpoint holds up its own deliveries, not those queued behind them."""
    only_webhook(endpoint)
    for index in range(8):
        webhooks.announce("slo.breached", {"objective": f"o{index}"})
    Endpoint.delay = 0.5
    began = time.perf_counter()
    assert webhooks.deliver_due(now=timezone.now()) == 8
    assert time.perf_counter() - began < 8 * 0.5 / 2  # one after another would take 4 s
    sent = sorted(json.loads(request["body"])["objective"] for request in Endpoint.received)
    assert sent == [f"o{index}" for index in range(8)]
    assert set(WebhookDelivery.objects.values_list("status", "attempts")) == {("delivered", 1)}


def test_claimed_deliveries_are_not_sent_again_until_their_lease_is_over(
    acme: None,  # noqa: F811
    world: World,
    endpoint: str,
) -> None:
    """A worker that dies between claiming and recording leaves its deliveries to the next one after
    the lease, not at once beside it."""
    only_webhook(endpoint)
    webhooks.announce("slo.breached", {"objective": "o"})
    now = timezone.now()
    assert len(webhooks._claim(now)) == 1  # and then the worker died
    assert webhooks.deliver_due(now=now + timedelta(minutes=1)) == 0
    assert Endpoint.received == []
    assert webhooks.deliver_due(now=now + webhooks.SENDING_LEASE) == 1
    assert len(Endpoint.received) == 1


def test_a_webhook_wanting_other_kinds_is_not_sent_this_one(
    acme: None,  # noqa: F811
    world: World,
    endpoint: str,
) -> None:
    only_webhook(endpoint, kinds=["slo.recovered"])
    breach(world)
    assert not WebhookDelivery.objects.exists()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"url": "http://93.184.215.14/hook"}, "must use https"),
        ({"url": "https://127.0.0.1/hook"}, "loopback"),
        ({"url": "https://169.254.169.254/latest"}, "link-local"),
        ({"url": "https://10.1.2.3/hook"}, "private"),
        ({"url": "https://[::ffff:127.0.0.1]/hook"}, "loopback"),
        ({"url": "https://0x7f000001/hook"}, "loopback"),
        ({"url": "ftp://93.184.215.14/"}, "not an https:// address"),
        ({"url": "https://93.184.215.14/hook", "secret_name": "NO_SUCH"}, "No tenant secret 'NO_SUCH'"),
        ({"url": "https://93.184.215.14/hook", "kinds": ["task.queued"]}, "Unknown event kinds task.queued"),
    ],
)
def test_a_webhook_klique_will_not_call_is_refused_saying_why(
    api: Callable[..., APIClient], world: World, body: dict[str, Any], words: str
) -> None:
    with override_settings(KLIQUE_OUTBOUND_ALLOW=[]):
        answer = api("alice").post(
            "/api/v1/webhooks/", {"secret_name": "SHARED_TOKEN", **body}, format="json"
        )
    assert answer.status_code == 400, answer.content
    assert words in str(answer.json())
