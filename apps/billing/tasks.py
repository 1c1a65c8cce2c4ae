"""Celery beat retries the usage pushes Stripe could not take."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from apps.billing import services


@shared_task(name="billing.push_pending")
def push_pending() -> dict[str, int]:
    if not settings.KLIQUE_STRIPE_API_KEY:
        return {}
    return services.push_pending()
