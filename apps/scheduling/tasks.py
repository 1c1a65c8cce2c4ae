"""Scheduling cycles as Celery tasks, run on events (debounced) and by beat as a safety net."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import redis
from django.conf import settings
from django.db import transaction

from apps.core.tenancy import tenant_task
from apps.scheduling.cycle import run_cycle

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)
_redis: redis.Redis | None = None


@tenant_task("scheduling.run_cycle", autoretry_for=(ConnectionError,), max_retries=3, retry_backoff=True)
def scheduling_cycle(tenant: Tenant) -> dict[str, object]:
    """One cycle for the tenant. Idempotent: a second run on the same state decides nothing new. When
    another worker holds the tenant's cycle, ask for one more afterwards so no event is lost."""
    result = run_cycle(tenant)
    if not result.ran:
        scheduling_cycle.apply_async(
            args=(tenant.schema_name,), countdown=settings.KLIQUE_CYCLE_DEBOUNCE_SECONDS
        )
    return {
        "ran": result.ran,
        "placed": result.placed,
        "preempted": result.preempted,
        "ms": result.milliseconds,
    }


def _client() -> redis.Redis:
    global _redis  # noqa: PLW0603 -- one connection pool per process
    if _redis is None:
        _redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    return _redis


def request_cycle(tenant: Tenant) -> None:
    """Ask for a cycle once the current transaction commits; events within the debounce window share one."""
    delay = settings.KLIQUE_CYCLE_DEBOUNCE_SECONDS

    def send() -> None:
        key = f"klique:cycle-requested:{tenant.schema_name}"
        try:
            if not _client().set(key, 1, nx=True, px=int(delay * 1000)):
                return  # a cycle is already on its way and will see this change
            scheduling_cycle.apply_async(args=(tenant.schema_name,), countdown=delay)
        except Exception:
            # Beat's periodic cycle picks the change up; the submit itself is committed.
            logger.warning("could not request a scheduling cycle", exc_info=True)

    transaction.on_commit(send)
