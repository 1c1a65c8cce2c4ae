"""The one place where Klique reads its configuration from the environment.

Every setting a deployment can change is read here, typed, and explained when it is wrong, so that a
bad value stops start-up with a sentence that says what to fix instead of a traceback deep in Django.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit


class ConfigError(Exception):
    """A configuration value is missing or malformed; the message says which and how to fix it."""


def text(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or default


def required_text(name: str, hint: str) -> str:
    value = text(name)
    if value is None:
        raise ConfigError(f"{name} is not set. {hint}")
    return value


def flag(name: str, *, default: bool) -> bool:
    value = text(name)
    if value is None:
        return default
    if value.lower() in {"1", "true", "yes", "on"}:
        return True
    if value.lower() in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; use true or false.")


def integer(name: str, *, default: int, minimum: int = 0) -> int:
    value = text(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number.") from None
    if number < minimum:
        raise ConfigError(f"{name}={number} is below its minimum of {minimum}.")
    return number


def words(name: str, default: tuple[str, ...] = ()) -> list[str]:
    value = text(name)
    if value is None:
        return list(default)
    return [word.strip() for word in value.split(",") if word.strip()]


DATABASE_HINT = (
    "Set it to a PostgreSQL URL such as postgres://klique@127.0.0.1:5432/klique, "
    "or run `klique up`, which starts an embedded PostgreSQL when none is configured."
)


def database_url() -> str:
    url = required_text("DATABASE_URL", DATABASE_HINT)
    scheme = urlsplit(url).scheme
    if scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ConfigError(
            f"DATABASE_URL uses {scheme!r}, but Klique needs PostgreSQL (one schema per tenant). "
            + DATABASE_HINT
        )
    return url


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    url = text("REDIS_URL", DEFAULT_REDIS_URL) or DEFAULT_REDIS_URL
    if urlsplit(url).scheme not in {"redis", "rediss", "unix"}:
        raise ConfigError(
            f"REDIS_URL={url!r} is not a Redis URL; use redis://host:6379/0 or unix:///path/to/redis.sock."
        )
    return url


def celery_broker_url(url: str) -> str:
    """Kombu spells a Redis unix socket `redis+socket://`; redis-py spells it `unix://`."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = f"?{parts.query}" if parts.query else ""
        return f"redis+socket://{parts.path}{query}"
    return url


def data_dir() -> Path:
    """Where `klique up` keeps embedded PostgreSQL and Redis, Celery beat's schedule and the like."""
    return Path(text("KLIQUE_DATA_DIR", ".klique") or ".klique").resolve()
