"""Waking what acts on a change: the scheduling cycle, and a pool's connected agents.

A request for a cycle sends the Celery task by its name, so that what asks (a submit, an agent's report,
a pool coming back) never imports the cycle itself. Each pool is a channel group its agents' sessions
join (apps.fleet.consumers); a notice to it is sent once the current transaction commits."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

import redis
from celery import current_app
from django.conf import settings
from django.db import connection, transaction

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


def _keys(schema_name: str) -> list[str]:
    """The tenant's throttle keys: while the lead lives no cycle starts at once; while the trail lives a
    cycle is on its way and has not started; the cost is the last cycle's milliseconds."""
    return [f"klique:cycle-{part}:{schema_name}" for part in ("lead", "trail", "cost")]


# After a cycle of d ms the next starts no sooner than GAP_FACTOR * d later: under a stream of events a
# tenant's cycles take at most a third of a worker, and each places all that arrived meanwhile. A cycle
# whose cost is not known yet is taken to cost GUESS_MS.
GAP_FACTOR = 2
GUESS_MS = 10

# The lead's span (ms) from now: the cycle expected to start now, and the gap after it, at most the
# window (ARGV[1]). ARGV[2]: the guess; ARGV[3]: 1 + GAP_FACTOR.
_SPAN = """
local cost = tonumber(redis.call('GET', KEYS[3]) or ARGV[2]) or tonumber(ARGV[2])
local span = math.min(tonumber(ARGV[1]), math.max(1, math.floor(cost * tonumber(ARGV[3]))))
"""

# What a request for a cycle does, in one round trip. No cycle is about: one runs now (0), and the lead
# holds the next back for its span. One is: a trailing cycle is sent for the lead's end (its delay in
# ms), unless one already is on its way (-1).
_REQUEST = (
    _SPAN
    + """
if redis.call('SET', KEYS[1], 1, 'NX', 'PX', span) then return 0 end
local left = redis.call('PTTL', KEYS[1])
if left < 1 then left = span end
if redis.call('SET', KEYS[2], 1, 'NX', 'PX', left) then return left end
return -1
"""
)

_START = _SPAN + "redis.call('SET', KEYS[1], 1, 'PX', span)\nreturn span\n"


def _window_ms() -> int:
    return int(settings.KLIQUE_CYCLE_DEBOUNCE_SECONDS * 1000)


def request_cycle(tenant: Tenant) -> None:
    """Ask for a cycle once the current transaction commits. A request after a quiet spell runs one at
    once. The requests made while a cycle runs, or within a gap after it as long as GAP_FACTOR times its
    cost, share one more at the gap's end; no request waits more than `KLIQUE_CYCLE_DEBOUNCE_MS`. So a
    task submitted to free capacity is placed without waiting, and a stream of events costs a bounded
    share of a worker, each cycle placing all that came meanwhile.

    No change is missed: a request that sends nothing found a trailing cycle on its way, whose key lives
    no longer than its countdown, so that cycle had not started and reads this commit. For the same
    reason the requests of one transaction ask once (an agent's burst of reports ends many runs): the
    request still pending at its commit covers every change the transaction made."""
    schema_name = tenant.schema_name
    if _pending_in_this_transaction(schema_name):
        return
    transaction.on_commit(_CycleRequest(schema_name, _window_ms()))


class _CycleRequest:
    """The request that request_cycle leaves to run when its transaction commits."""

    def __init__(self, schema_name: str, window_ms: int) -> None:
        self.schema_name, self.window_ms = schema_name, window_ms
        self.made = False  # (a test may run a transaction's callbacks without ending the transaction)

    def __call__(self) -> None:
        self.made = True
        try:
            client = _client()
            client.sadd(due.key("cycle"), self.schema_name)  # beat's safety net visits it while work is due
            if self.window_ms <= 0:
                send_cycle(self.schema_name, countdown=0)
                return
            delay_ms = client.eval(
                _REQUEST, 3, *_keys(self.schema_name), self.window_ms, GUESS_MS, 1 + GAP_FACTOR
            )
            if delay_ms >= 0:
                send_cycle(self.schema_name, countdown=delay_ms / 1000)
        except Exception:
            # Beat's periodic cycle picks the change up; the submit itself is committed.
            logger.warning("could not request a scheduling cycle", exc_info=True)


def _pending_in_this_transaction(schema_name: str) -> bool:
    """Whether the current transaction already asks for a cycle of `schema_name` when it commits. Django
    drops what a rollback (to a savepoint too) undoes from its list, so a request still listed stands."""
    if not connection.in_atomic_block:
        return False
    pending = (entry[1] for entry in connection.run_on_commit)  # (savepoints, callback, robust)
    return any(
        isinstance(callback, _CycleRequest) and callback.schema_name == schema_name and not callback.made
        for callback in pending
    )


def cycle_starting(schema_name: str) -> None:
    """A cycle of the tenant starts now (asked for, or beat's): the requests made while it runs, and in
    the gap after it, share one cycle after the gap."""
    window_ms = _window_ms()
    if window_ms <= 0:
        return
    try:
        _client().eval(_START, 3, *_keys(schema_name), window_ms, GUESS_MS, 1 + GAP_FACTOR)
    except redis.RedisError:
        logger.warning("could not mark the start of a scheduling cycle", exc_info=True)


def cycle_ended(schema_name: str, milliseconds: float) -> None:
    """A cycle of the tenant took `milliseconds`: the next starts no sooner than GAP_FACTOR times that
    from now (at most the window), and the next cycle's span is foreseen from it."""
    window_ms = _window_ms()
    if window_ms <= 0:
        return
    lead, _, cost = _keys(schema_name)
    try:
        pipe = _client().pipeline(transaction=False)
        pipe.set(cost, max(1, round(milliseconds)), ex=3600)
        pipe.set(lead, 1, px=max(1, min(window_ms, round(GAP_FACTOR * milliseconds))))
        pipe.execute()
    except redis.RedisError:
        logger.warning("could not record the end of a scheduling cycle", exc_info=True)


def pool_group(schema_name: str, pool_id: object) -> str:
    return f"agents.{schema_name}.{pool_id}"


def notify_pool(*, tenant: Tenant, pool_id: object, message: dict[str, Any]) -> None:
    """Send `message` to the pool's connected agents once the current transaction commits."""
    group = pool_group(tenant.schema_name, pool_id)
    # Its id lets the agents of one web process tell one notice, which each of them gets, from two.
    notice = {"type": "plane.message", "message": message, "notice": uuid.uuid4().hex}
    transaction.on_commit(lambda: send_to_group(group, notice, what=f"a {message.get('type')} notice"))
