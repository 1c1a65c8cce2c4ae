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
    """Send every delivery that is due, each under its row lock (two workers never send one twice at
    once); how many were answered 2xx."""
    now = now or timezone.now()
    delivered = 0
    due = WebhookDelivery.objects.filter(status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=now)
    for delivery_id in list(due.values_list("pk", flat=True)[:500]):
        with transaction.atomic():
            delivery = (
                WebhookDelivery.objects.select_for_update(skip_locked=True)
                .select_related("webhook")
                .filter(pk=delivery_id, status=WebhookDelivery.Status.PENDING)
                .first()
            )
            if delivery is not None:
                delivered += _attempt(delivery, now)
    return delivered


def _attempt(delivery: WebhookDelivery, now: datetime) -> bool:
    body = json.dumps({"delivery": str(delivery.pk), **delivery.payload}, separators=(",", ":")).encode()
    stamp = str(int(time.time()))
    problem = ""
    try:
        key = vault.tenant_secret(delivery.webhook.secret_name, reader="webhook delivery")
        headers = {
            "Content-Type": "application/json",
            "X-Klique-Event": delivery.kind,
            "X-Klique-Delivery": str(delivery.pk),
            "X-Klique-Timestamp": stamp,
            "X-Klique-Signature": signature(key, stamp, body),
        }
        with outbound.client(timeout=10.0) as http:
            answer = http.post(delivery.webhook.url, content=body, headers=headers)
        if answer.is_success:
            delivery.status, delivery.delivered_at = WebhookDelivery.Status.DELIVERED, now
        else:
            problem = f"the endpoint answered {answer.status_code}"
    except httpx.HTTPError as error:
        problem = f"the endpoint cannot be reached: {error}"
    except NotFound as error:  # the secret deleted since: kept as the delivery's error
        problem = f"the signing secret cannot be read: {error}"
    delivery.attempts += 1
    delivery.last_error = problem[:500]
    if problem:
        wait = min(LONGEST_RETRY_SECONDS, FIRST_RETRY_SECONDS * 2 ** (delivery.attempts - 1))
        delivery.next_attempt_at = now + timedelta(seconds=wait)
        if delivery.attempts >= MAX_ATTEMPTS:
            delivery.status = WebhookDelivery.Status.FAILED
    delivery.save()
    return not problem
