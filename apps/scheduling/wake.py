"""Waking what acts on a change: the scheduling cycle, and a pool's connected agents.

A request for a cycle sends the Celery task by its name, so that what asks (a submit, an agent's report,
a pool coming back) never imports the cycle itself. Each pool is a channel group its agents' sessions
join (apps.fleet.consumers); a notice to it is sent once the current transaction commits."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import redis
from celery import current_app
from django.conf import settings
from django.db import transaction

from apps.core.events import send_to_group
from tenants import due

if TYPE_CHECKING:
    from tenants.models import Tenant

logger = logging.getLogger(__name__)

CYCLE_TASK = "scheduling.run_cycle"  # apps.scheduling.tasks.scheduling_cycle
_redis: redis.Redis | None = None


def _client() -> redis.Redis:
    global _redis  # noqa: PLW0603 -- one connection pool per process
    if _redis is None:
        _redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    return _redis


def send_cycle(schema_name: str, *, countdown: float) -> None:
    """Queue a cycle for the tenant in `countdown` seconds."""
    current_app.send_task(CYCLE_TASK, args=(schema_name,), countdown=countdown)


def request_cycle(tenant: Tenant) -> None:
    """Ask for a cycle once the current transaction commits; events within the debounce window share one."""
    delay = settings.KLIQUE_CYCLE_DEBOUNCE_SECONDS

    def send() -> None:
        key = f"klique:cycle-requested:{tenant.schema_name}"
        try:
            pipe = _client().pipeline(transaction=False)
            pipe.sadd(due.key("cycle"), tenant.schema_name)  # beat's safety net visits it while work is due
            pipe.set(key, 1, nx=True, px=int(delay * 1000))
            _, requested = pipe.execute()
            if not requested:
                return  # a cycle is already on its way and will see this change
            send_cycle(tenant.schema_name, countdown=delay)
        except Exception:
            # Beat's periodic cycle picks the change up; the submit itself is committed.
            logger.warning("could not request a scheduling cycle", exc_info=True)

    transaction.on_commit(send)


def pool_group(schema_name: str, pool_id: object) -> str:
    return f"agents.{schema_name}.{pool_id}"


def notify_pool(*, tenant: Tenant, pool_id: object, message: dict[str, Any]) -> None:
    """Send `message` to the pool's connected agents once the current transaction commits."""
    group = pool_group(tenant.schema_name, pool_id)
    notice = {"type": "plane.message", "message": message}
    transaction.on_commit(lambda: send_to_group(group, notice, what=f"a {message.get('type')} notice"))
