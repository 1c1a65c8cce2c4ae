"""Usage rows that PostgreSQL could not take wait in Redis, and Celery beat writes them, once."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from django_tenants.utils import schema_context

from gateway.cache import USAGE_OUTBOX, UsageRow, UsageWriter, async_redis, sync_redis
from gateway.models import Usage
from gateway.tasks import drain_usage_outbox
from tests.world import World

pytestmark = pytest.mark.django_db


def row(request_id: str, world: World) -> UsageRow:
    return UsageRow(
        request_id=request_id,
        at=datetime(2026, 11, 30, 9, tzinfo=UTC),
        user_id=world.users["bob"],
        username="bob",
        project_id=world.project_a,
        project_name="apollo",
        token_prefix="abcdefgh",
        agent="",
        endpoint="chat.completions",
        model="chat",
        deployment="chat#0",
        tokens_in=3,
        tokens_out=7,
        cost_nano_usd=17_000,
        status="ok",
        duration_ms=12,
    )


class BrokenPool:
    def connection(self) -> None:
        raise OSError("PostgreSQL is down")


async def write_while_postgres_is_down(rows: list[UsageRow]) -> None:
    redis = async_redis()
    writer = UsageWriter(redis)
    writer.pool = BrokenPool()
    try:
        await asyncio.gather(*(writer.write("acme", item) for item in rows))
    finally:
        await redis.aclose()


def test_rows_wait_in_redis_when_postgres_is_down_and_are_written_once(world: World) -> None:
    sync_redis().delete(USAGE_OUTBOX)
    rows = [row("kqr-outbox-1", world), row("kqr-outbox-2", world)]
    asyncio.run(write_while_postgres_is_down(rows))
    assert sync_redis().llen(USAGE_OUTBOX) == 2
    # A replayed row (the same request id twice) counts once.
    sync_redis().rpush(USAGE_OUTBOX, rows[0].to_json("acme"))
    assert drain_usage_outbox() == 3
    assert sync_redis().llen(USAGE_OUTBOX) == 0
    with schema_context("acme"):
        written = Usage.objects.filter(request_id__startswith="kqr-outbox-").order_by("request_id")
        assert [(u.request_id, u.tokens_out, u.cost_nano_usd) for u in written] == [
            ("kqr-outbox-1", 7, 17_000),
            ("kqr-outbox-2", 7, 17_000),
        ]
    assert drain_usage_outbox() == 0
