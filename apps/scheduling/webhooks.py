"""Announcements to a tenant's own HTTPS endpoints (webhooks), signed, retried, with a delivery log.

Each announcement becomes one delivery per webhook that wants its kind, written in the transaction that
announces it, and is sent afterwards (and retried by beat) until the endpoint answers 2xx: with backoff,
at most MAX_ATTEMPTS times, then kept as failed with the last error. A delivery carries its id, so an
endpoint that sees one twice (an answer lost on the way back) can tell.

Every request goes through the client that refuses internal addresses (apps/core/outbound.py), to the
URL checked when the webhook was set: https, at a public address (plain http only within a range the
provider allowed with KLIQUE_OUTBOUND_ALLOW). The signature is HMAC-SHA256, keyed with the value of a
tenant secret the webhook names, over "<timestamp>.<body>":

    X-Klique-Event: slo.breached
    X-Klique-Delivery: <delivery id>
    X-Klique-Timestamp: <unix seconds>
    X-Klique-Signature: sha256=<hex>
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.utils import timezone

from apps.core import outbound
from apps.core.errors import InvalidInput, NotFound
from apps.scheduling.models import EventWebhook, WebhookDelivery
from apps.vault import services as vault

MAX_ATTEMPTS = 10
FIRST_RETRY_SECONDS = 30.0
LONGEST_RETRY_SECONDS = 3600.0
KINDS = ("slo.at_risk", "slo.breached", "slo.recovered")


def _checked_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput(f"{url[:100]!r} is not an https:// address.", field="url")
    try:
        outbound.check_secure_url(url, why="announcements are signed, not secret")
    except outbound.OutboundRefused as refused:
        raise InvalidInput(str(refused), field="url") from None
    return url


def webhook_save(*, url: str, secret_name: str, kinds: list[str], actor: str) -> EventWebhook:
    """Add a webhook, refusing an address Klique does not call, a secret that does not exist, an unknown
    kind."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise InvalidInput(
            f"Unknown event kinds {', '.join(unknown)}; webhooks are sent {', '.join(KINDS)}.", field="kinds"
        )
    try:
        vault.tenant_secret(secret_name, reader=f"{actor} (webhook check)")
    except NotFound:
        raise InvalidInput(
            f"No tenant secret {secret_name!r}: keep the signing key with POST /api/v1/secrets/ (scope "
            "tenant) first.",
            field="secret_name",
        ) from None
    return EventWebhook.objects.create(
        url=_checked_url(url), secret_name=secret_name, kinds=sorted(set(kinds)), created_by=actor
    )


def announce(kind: str, payload: dict[str, Any]) -> int:
    """Queue `kind` for every webhook that wants it, in the caller's transaction; how many."""
    wanted = [hook for hook in EventWebhook.objects.all() if not hook.kinds or kind in hook.kinds]
    body = json.loads(json.dumps({"kind": kind, **payload}, cls=DjangoJSONEncoder))
    WebhookDelivery.objects.bulk_create(
        WebhookDelivery(webhook=hook, kind=kind, payload=body) for hook in wanted
    )
    return len(wanted)


def signature(key: str, timestamp: str, body: bytes) -> str:
    return "sha256=" + hmac.new(key.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def deliver_due(*, now: datetime | None = None) -> int:
    """Send the deliveries that are due, side by side; how many were answered 2xx.

    They are claimed first, in one short transaction (rows locked, skipping those another worker holds),
    by moving their next attempt SENDING_LEASE ahead: no other worker sends them meanwhile, and none of
    them waits on another's endpoint. Their outcomes are written together after. A worker that dies in
    between leaves them to be sent again once the lease is over: an endpoint may see a delivery twice,
    and its id says so."""
    now = now or timezone.now()
    claimed = _claim(now)
    if not claimed:
        return 0
    keys: dict[str, str] = {}
    unreadable: dict[str, str] = {}  # the secret deleted since: kept as the delivery's error
    for name in {delivery.webhook.secret_name for delivery in claimed}:
        try:
            keys[name] = vault.tenant_secret(name, reader="webhook delivery")
        except NotFound as error:
            unreadable[name] = f"the signing secret cannot be read: {error}"

    def attempt(delivery: WebhookDelivery) -> str:
        name = delivery.webhook.secret_name
        return unreadable[name] if name in unreadable else _send(delivery, keys[name])

    with ThreadPoolExecutor(max_workers=min(SENDING_AT_ONCE, len(claimed))) as pool:
        problems = list(pool.map(attempt, claimed))
    for delivery, problem in zip(claimed, problems, strict=True):
        _record(delivery, problem, now)
    WebhookDelivery.objects.bulk_update(
        claimed, ["status", "delivered_at", "attempts", "last_error", "next_attempt_at"]
    )
    return problems.count("")


SENDING_AT_ONCE = 16  # requests in flight at once
TIMEOUT_SECONDS = 10.0  # each request's
BATCH = 200  # deliveries claimed at once: at worst (every endpoint silent) 200 / 16 x 10 s = 125 s
SENDING_LEASE = timedelta(minutes=5)  # longer than a batch's sending can take


@transaction.atomic
def _claim(now: datetime) -> list[WebhookDelivery]:
    claimed = list(
        WebhookDelivery.objects.select_for_update(skip_locked=True, of=("self",))
        .select_related("webhook")
        .filter(status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=now)
        .order_by("next_attempt_at")[:BATCH]
    )
    WebhookDelivery.objects.filter(pk__in=[delivery.pk for delivery in claimed]).update(
        next_attempt_at=now + SENDING_LEASE
    )
    return claimed


def _send(delivery: WebhookDelivery, key: str) -> str:
    """Post one delivery (in a sending thread: no database here); what went wrong, or ''."""
    body = json.dumps({"delivery": str(delivery.pk), **delivery.payload}, separators=(",", ":")).encode()
    stamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "X-Klique-Event": delivery.kind,
        "X-Klique-Delivery": str(delivery.pk),
        "X-Klique-Timestamp": stamp,
        "X-Klique-Signature": signature(key, stamp, body),
    }
    try:
        with outbound.client(timeout=TIMEOUT_SECONDS) as http:
            answer = http.post(delivery.webhook.url, content=body, headers=headers)
    except httpx.HTTPError as error:
        return f"the endpoint cannot be reached: {error}"
    return "" if answer.is_success else f"the endpoint answered {answer.status_code}"


def _record(delivery: WebhookDelivery, problem: str, now: datetime) -> None:
    delivery.attempts += 1
    delivery.last_error = problem[:500]
    if not problem:
        delivery.status, delivery.delivered_at = WebhookDelivery.Status.DELIVERED, now
        return
    wait = min(LONGEST_RETRY_SECONDS, FIRST_RETRY_SECONDS * 2 ** (delivery.attempts - 1))
    delivery.next_attempt_at = now + timedelta(seconds=wait)
    if delivery.attempts >= MAX_ATTEMPTS:
        delivery.status = WebhookDelivery.Status.FAILED
