"""How a person signed in to the portal reaches an app on its own host: a one-time ticket, then a cookie
of the app's host that names the portal session (so signing out of the portal closes every app too).

Both are signed with the deployment's secret key. A ticket is good once, for TICKET_SECONDS; a cookie is
good while its session is and only for its own app. Neither is ever passed on to the app.
"""

from __future__ import annotations

import secrets
from typing import Any

import redis
from django.conf import settings
from django.core import signing

TICKET_SECONDS = 60
COOKIE = "klique_app"
COOKIE_SECONDS = 12 * 3600
_TICKET_SALT, _COOKIE_SALT = "klique.apps.ticket", "klique.apps.cookie"
_redis: redis.Redis | None = None


def _client() -> redis.Redis:
    global _redis  # noqa: PLW0603 -- one connection pool per process
    if _redis is None:
        _redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    return _redis


def ticket(*, session_key: str, app_id: str) -> str:
    return signing.dumps({"s": session_key, "a": app_id, "n": secrets.token_urlsafe(16)}, salt=_TICKET_SALT)


def redeem(value: str, *, app_id: str) -> str | None:
    """The session key a ticket carries, once: None for a ticket that is forged, expired, for another app
    or used before."""
    try:
        content: Any = signing.loads(value, salt=_TICKET_SALT, max_age=TICKET_SECONDS)
    except signing.BadSignature:
        return None
    if not isinstance(content, dict) or content.get("a") != app_id or not isinstance(content.get("s"), str):
        return None
    if not _client().set(f"klique:apps:ticket:{content['n']}", 1, nx=True, ex=TICKET_SECONDS * 2):
        return None
    return str(content["s"])


def cookie(*, session_key: str, app_id: str) -> str:
    return signing.dumps({"s": session_key, "a": app_id}, salt=_COOKIE_SALT)


def cookie_session(value: str, *, app_id: str) -> str | None:
    """The portal session a cookie of the app's host names; None if forged, stale, or another app's."""
    try:
        content: Any = signing.loads(value, salt=_COOKIE_SALT, max_age=COOKIE_SECONDS)
    except signing.BadSignature:
        return None
    if not isinstance(content, dict) or content.get("a") != app_id or not isinstance(content.get("s"), str):
        return None
    return str(content["s"])
