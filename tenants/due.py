"""Which tenants have periodic work due: marks kept in Redis as things happen, so that beat's periodic
tasks go only to the tenants that have something to do, and ten thousand tenants at rest cost (almost)
nothing.

- A **kind** names a piece of periodic work (`cycle`, `gateway_calls`, `objectives`, `storage`,
  `token_purge`). Its mark is one Redis set of schema names: `klique:due:<kind>`.
- What makes work **marks** the tenant as it happens: a change that asks for a scheduling cycle marks
  `cycle`, a gateway call's usage row marks `gateway_calls`, a stored output marks `storage`.
- The periodic task **settles** its mark: it takes the mark away *before* it works, and marks again after
  if its kind's predicate says work is still due (tasks still queued or running, calls not metered yet).
  Taken away first, a mark set by an event during the work is never lost: the event marks again after,
  or the work saw it.
- **The walk** is the slow safety net: every tick it visits the next page of tenants (by schema name,
  wrapping round) and, inside each, asks every kind's predicate, marking those due. Marks lost with
  Redis (restarted without its data), work that no event announces (a token turning purgeable with time,
  an objective's window sliding) and a tenant that existed before marks did are all found within one
  sweep: pages of `KLIQUE_DUE_WALK_PAGE` tenants every `KLIQUE_DUE_WALK_SECONDS`.
- **Marks lost at once.** A sweep of ten thousand tenants takes most of an hour, too long for queued work
  to wait after Redis restarted empty. A key (`klique:due:kept`) lives beside the marks; the walk that
  finds it gone knows the marks went with it, and asks every tenant's `cycle` predicate in that one pass
  (one query a tenant), so work in play is scheduled again within a walk's tick.

Marking is best effort: when Redis does not answer, the change itself is committed and the walk finds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import redis
from django.conf import settings
from django.db import transaction

logger = logging.getLogger(__name__)

KINDS = ("cycle", "gateway_calls", "objectives", "storage", "token_purge")
CURSOR = "klique:due-walk:cursor"
KEPT = "klique:due:kept"  # there while Redis keeps the marks; gone with them
_client: redis.Redis | None = None

# kind -> is work of that kind due in the current schema? (registered by the app that does the work)
_predicates: dict[str, Callable[[], bool]] = {}


def key(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown kind of periodic work {kind!r}; one of {', '.join(KINDS)}")
    return f"klique:due:{kind}"


def client() -> redis.Redis:
    global _client  # noqa: PLW0603 -- one connection pool per process
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    return _client


def predicate(kind: str) -> Callable[[Callable[[], bool]], Callable[[], bool]]:
    """Register the test of whether work of `kind` is due in the current schema (the walk and settle ask)."""
    key(kind)

    def register(test: Callable[[], bool]) -> Callable[[], bool]:
        _predicates[kind] = test
        return test

    return register


def mark(schema_names: str | Iterable[str], kind: str) -> None:
    """Mark the tenants: work of `kind` is due. Best effort (the walk finds what a lost mark hid)."""
    names = [schema_names] if isinstance(schema_names, str) else list(schema_names)
    if not names:
        return
    try:
        client().sadd(key(kind), *names)
    except redis.RedisError:
        logger.warning("could not mark periodic work due", extra={"kind": kind}, exc_info=True)


def cursor() -> str:
    """Where the walk stopped (the last schema it visited; empty: at the start)."""
    value = client().get(CURSOR)
    return value.decode() if isinstance(value, bytes) else (value or "")


def lost() -> bool:
    """Whether the marks were lost since the last walk asked (Redis restarted without its data, or this
    deployment's first walk). Asking sets the key again: True once per loss."""
    return bool(client().set(KEPT, "1", nx=True))


def mark_on_commit(schema_name: str, kind: str) -> None:
    transaction.on_commit(lambda: mark(schema_name, kind))


def marked(kinds: Iterable[str]) -> set[str]:
    """The schemas marked for any of `kinds`."""
    names = client().sunion([key(kind) for kind in kinds])
    return {name.decode() if isinstance(name, bytes) else str(name) for name in names}


def settle(schema_name: str, kind: str, work: Callable[[], object]) -> object:
    """Take the tenant's mark away, do the work, and mark again if the kind's predicate still holds."""
    try:
        client().srem(key(kind), schema_name)
    except redis.RedisError:
        logger.warning("could not settle periodic work", extra={"kind": kind}, exc_info=True)
    try:
        result = work()
    except BaseException:
        mark(schema_name, kind)  # not done: still due
        raise
    still = _predicates.get(kind)
    if still is not None and still():
        mark(schema_name, kind)
    return result


def due_here(kinds: Iterable[str] | None = None) -> list[str]:
    """The kinds (of `kinds`, or all) whose predicate holds in the current schema (what the walk marks)."""
    names = _predicates.keys() if kinds is None else [kind for kind in kinds if kind in _predicates]
    return [kind for kind in names if _predicates[kind]()]
