"""The gateway process's connections: Redis (sync for Django's side, async for the hot path), PostgreSQL for
the usage writer, and the writer itself.

Usage rows are written by group commit: a call hands its row to the writer and waits; the writer inserts
every row waiting at that moment in one statement (`ON CONFLICT (request_id) DO NOTHING`), so under load
many calls share one round trip, and a replayed row changes nothing. Where PostgreSQL cannot take them,
rows go to a Redis list that Celery beat drains into the table (`gateway.tasks.drain_usage_outbox`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass
from datetime import datetime
from functools import cache
from typing import Any

import redis
import redis.asyncio
from django.conf import settings
from django.db import connections
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from tenants import due

log = logging.getLogger("klique.gateway")

USAGE_OUTBOX = "kq:gw:usage-outbox"
USAGE_COLUMNS = (
    "request_id",
    "at",
    "user_id",
    "username",
    "project_id",
    "project_name",
    "token_prefix",
    "agent",
    "endpoint",
    "model",
    "deployment",
    "tokens_in",
    "tokens_out",
    "cost_nano_usd",
    "status",
    "duration_ms",
)


@cache
def sync_redis() -> Any:
    return redis.Redis.from_url(settings.REDIS_URL)


def async_redis() -> Any:
    return redis.asyncio.Redis.from_url(settings.REDIS_URL)


# OPTIONS that are libpq connection parameters (others, such as Django's pool settings, are not).
LIBPQ_OPTIONS = frozenset(
    {"host", "hostaddr", "port", "sslmode", "sslrootcert", "sslcert", "sslkey", "connect_timeout", "options",
     "target_session_attrs", "passfile", "service", "sslcrl", "gssencmode", "channel_binding"}
)  # fmt: skip


def database_conninfo() -> str:
    """libpq parameters of Django's default database (the test database under pytest), its OPTIONS
    included: the embedded PostgreSQL of `klique up` is reached through `?host=<socket folder>`, which
    Django keeps in OPTIONS, not HOST."""

    database = connections["default"].settings_dict
    options = {
        key: str(value) for key, value in (database.get("OPTIONS") or {}).items() if key in LIBPQ_OPTIONS
    }
    parameters = {
        "dbname": database["NAME"],
        "user": database.get("USER") or None,
        "password": database.get("PASSWORD") or None,
        "host": database.get("HOST") or None,
        "port": str(database["PORT"]) if database.get("PORT") else None,
        "application_name": "klique-gateway",
    }
    given = {key: value for key, value in parameters.items() if value}
    return make_conninfo(**{**options, **given})


@dataclass(frozen=True)
class UsageRow:
    request_id: str
    at: datetime
    user_id: str
    username: str
    project_id: str | None
    project_name: str
    token_prefix: str
    agent: str
    endpoint: str
    model: str
    deployment: str
    tokens_in: int
    tokens_out: int
    cost_nano_usd: int
    status: str
    duration_ms: int

    def values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, column) for column in USAGE_COLUMNS)

    def to_json(self, schema: str) -> str:
        return json.dumps({"schema": schema, **asdict(self), "at": self.at.isoformat()})

    @classmethod
    def from_json(cls, text: str) -> tuple[str, UsageRow]:
        data = json.loads(text)
        schema = data.pop("schema")
        data["at"] = datetime.fromisoformat(data["at"])
        return schema, cls(**data)


def insert_sql(schema: str, rows: int) -> Any:
    one = sql.SQL("({})").format(sql.SQL(", ").join(sql.Placeholder() * len(USAGE_COLUMNS)))
    return sql.SQL("INSERT INTO {}.gateway_usage ({}) VALUES {} ON CONFLICT (request_id) DO NOTHING").format(
        sql.Identifier(schema),
        sql.SQL(", ").join(map(sql.Identifier, USAGE_COLUMNS)),
        sql.SQL(", ").join([one] * rows),
    )


class UsageWriter:
    """Group commit of usage rows on one event loop."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.pool: Any = None
        self.pending: list[tuple[str, UsageRow, asyncio.Future[None]]] = []
        self.flushing = False

    async def _pool(self) -> Any:
        if self.pool is None:
            self.pool = AsyncConnectionPool(database_conninfo(), min_size=1, max_size=4, open=False)
            await self.pool.open()
        return self.pool

    async def write(self, schema: str, row: UsageRow) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending.append((schema, row, future))
        if not self.flushing:
            self.flushing = True
            asyncio.get_running_loop().create_task(self._flush())
        await future

    async def _flush(self) -> None:
        try:
            while self.pending:
                batch, self.pending = self.pending, []
                try:
                    await self._insert(batch)
                except Exception:
                    log.exception("usage rows could not be written; they wait in Redis for the worker")
                    await self._outbox(batch)
                for _, _, future in batch:
                    if not future.done():
                        future.set_result(None)
        finally:
            self.flushing = False

    async def _insert(self, batch: list[tuple[str, UsageRow, asyncio.Future[None]]]) -> None:
        by_schema: dict[str, list[UsageRow]] = {}
        for schema, row, _ in batch:
            by_schema.setdefault(schema, []).append(row)
        pool = await self._pool()
        async with pool.connection() as connection, connection.transaction():
            for schema, rows in by_schema.items():
                await connection.execute(
                    insert_sql(schema, len(rows)), [value for row in rows for value in row.values()]
                )
        try:  # the calls' tenants have metering due (tenants/due.py); the walk finds a mark lost here
            await self.redis.sadd(due.key("gateway_calls"), *by_schema)
        except Exception:
            log.warning("could not mark gateway calls to meter", exc_info=True)

    async def _outbox(self, batch: list[tuple[str, UsageRow, asyncio.Future[None]]]) -> None:
        try:
            await self.redis.rpush(USAGE_OUTBOX, *[row.to_json(schema) for schema, row, _ in batch])
        except Exception:
            for schema, row, _ in batch:  # neither store answers: the row goes to the log, so it is not lost
                log.exception("usage row kept only in this log", extra={"usage": row.to_json(schema)})
