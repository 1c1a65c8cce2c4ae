"""The two Redis scripts on the real Redis: holds, clamping, settlement, epochs, missing counters, sweeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest

from gateway.budgets import (
    HOLDING,
    HOLDING_COMPLETE,
    Budget,
    Budgets,
    Exhausted,
    Missing,
    Stale,
    budget_key,
    epoch_key,
    holds_key,
    nano_per_token,
    sweep,
    sweep_all,
)
from gateway.cache import async_redis, sync_redis

SCHEMA = "budget_script_test"
# Today at noon: counters expire at an absolute time (a week past their period), so a fixed date would
# make their time to live depend on the day the suite runs.
NOW = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0)
T = TypeVar("T")


def run(work: Callable[[Budgets], Awaitable[T]]) -> T:
    async def scoped() -> T:
        redis = async_redis()
        try:
            return await work(Budgets(redis))
        finally:
            await redis.aclose()

    return asyncio.run(scoped())


@pytest.fixture(autouse=True)
def clean() -> Any:
    def clear() -> None:
        for key in sync_redis().scan_iter(f"kq:gw:{SCHEMA}:*"):
            sync_redis().delete(key)
        sync_redis().srem(HOLDING, SCHEMA)

    clear()
    yield
    clear()


TOKENS = Budget(id="t", label="the test budget", unit="tokens", limit=100, period="day")
MONEY = Budget(id="m", label="the test wallet", unit="usd", limit=50_000, period="none")


def reserve(
    budgets: Budgets,
    *chosen: Budget,
    request_id: str = "r1",
    prompt: int = 10,
    max_tokens: int = 20,
    epoch: str = "0",
) -> Any:
    return budgets.reserve(
        schema=SCHEMA,
        epoch=epoch,
        request_id=request_id,
        budgets=chosen,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        price_in=1000,
        price_out=2000,
        now=NOW,
    )


async def started(budgets: Budgets, *chosen: Budget, spent: int = 0) -> None:
    for budget in chosen:
        await budgets.start(budget_key(SCHEMA, budget, NOW), spent, budget, NOW)


def test_a_missing_counter_is_reported_so_it_can_start_from_the_ledger() -> None:
    async def work(budgets: Budgets) -> None:
        with pytest.raises(Missing) as missing:
            await reserve(budgets, TOKENS)
        today = NOW.date().isoformat()
        assert missing.value.key == budget_key(SCHEMA, TOKENS, NOW) == f"kq:gw:{SCHEMA}:budget:t:{today}"
        await budgets.start(missing.value.key, 60, TOKENS, NOW)
        await budgets.start(missing.value.key, 0, TOKENS, NOW)  # a second start changes nothing
        assert await budgets.counters(missing.value.key) == (60, 0)
        assert await budgets.redis.ttl(missing.value.key) > 6 * 86400  # kept a week past its period

    run(work)


def test_a_hold_is_clamped_to_the_room_left_and_settled_to_the_real_cost() -> None:
    async def work(budgets: Budgets) -> None:
        await started(budgets, TOKENS, spent=75)
        held = await reserve(budgets, TOKENS)  # 25 left: 10 of prompt, 15 of reply
        assert held.max_tokens == 15
        assert await budgets.counters(held.keys[0]) == (75, 25)
        await budgets.settle(schema=SCHEMA, request_id="r1", keys=held.keys, costs=[20])
        assert await budgets.counters(held.keys[0]) == (95, 0)
        assert await budgets.redis.hlen(holds_key(SCHEMA)) == 0
        with pytest.raises(Exhausted) as refused:
            await reserve(budgets, TOKENS, request_id="r2")  # 5 left: the prompt and one token do not fit
        assert refused.value.sentence().startswith(
            "No room left in the test budget this day: 95 tokens of 100"
        )

    run(work)


def test_the_tightest_budget_decides_and_every_budget_holds() -> None:
    async def work(budgets: Budgets) -> None:
        await started(budgets, TOKENS, MONEY)
        held = await reserve(budgets, TOKENS, MONEY)
        # money: 50,000 - 10 x 1,000 = 40,000 pays for 20 tokens at 2,000; tokens: 100 - 10 = 90.
        assert held.max_tokens == 20
        assert await budgets.counters(held.keys[1]) == (0, 10 * 1000 + 20 * 2000)
        with pytest.raises(Exhausted) as refused:
            await reserve(budgets, TOKENS, MONEY, request_id="r2")
        assert refused.value.budget is MONEY
        assert "(0.00005 USD more held by calls in flight)" in refused.value.sentence()
        assert await budgets.counters(held.keys[0]) == (0, 30)  # the refused call held nothing

    run(work)


def test_a_stale_epoch_reserves_nothing() -> None:
    async def work(budgets: Budgets) -> None:
        await started(budgets, TOKENS)
        await budgets.redis.incr(epoch_key(SCHEMA))
        with pytest.raises(Stale):
            await reserve(budgets, TOKENS)
        assert await budgets.counters(budget_key(SCHEMA, TOKENS, NOW)) == (0, 0)
        assert (await reserve(budgets, TOKENS, epoch="1")).max_tokens == 20

    run(work)


def test_a_release_gives_the_hold_back_once() -> None:
    async def work(budgets: Budgets) -> None:
        await started(budgets, TOKENS)
        held = await reserve(budgets, TOKENS)
        await budgets.release(schema=SCHEMA, request_id="r1", keys=held.keys)
        await budgets.release(schema=SCHEMA, request_id="r1", keys=held.keys)
        assert await budgets.counters(held.keys[0]) == (0, 0)

    run(work)


def test_the_sweep_gives_back_holds_of_calls_that_never_settled() -> None:
    async def work(budgets: Budgets) -> None:
        await started(budgets, TOKENS, MONEY)
        await reserve(budgets, TOKENS, MONEY, request_id="dead")
        await reserve(budgets, TOKENS, request_id="alive")

    run(work)
    assert sweep(sync_redis(), SCHEMA) == 0  # both are young
    assert sweep(sync_redis(), SCHEMA, now=time.time() + 3 * 3600) == 2
    assert sync_redis().hgetall(budget_key(SCHEMA, TOKENS, NOW)) == {b"spent": b"0", b"reserved": b"0"}
    assert sync_redis().hget(budget_key(SCHEMA, MONEY, NOW), "reserved") == b"0"


def test_a_schema_is_swept_while_it_has_holds_and_leaves_the_sweep_with_its_last() -> None:
    async def hold(budgets: Budgets) -> None:
        await started(budgets, TOKENS)
        await reserve(budgets, TOKENS, request_id="alive")

    run(hold)
    assert sync_redis().sismember(HOLDING, SCHEMA)  # made in the script that made the hold
    assert sweep(sync_redis(), SCHEMA) == 0
    assert sync_redis().sismember(HOLDING, SCHEMA)  # a young hold stays, and so does its schema

    async def settle(budgets: Budgets) -> None:
        await budgets.settle(
            schema=SCHEMA, request_id="alive", keys=(budget_key(SCHEMA, TOKENS, NOW),), costs=[5]
        )

    run(settle)
    assert sweep(sync_redis(), SCHEMA) == 0
    assert not sync_redis().sismember(HOLDING, SCHEMA)  # none left: not visited again


def test_the_periodic_sweep_visits_the_schemas_holding_after_one_walk_of_every_schema() -> None:
    late = time.time() + 3 * 3600

    async def dead_call(budgets: Budgets) -> None:
        await started(budgets, TOKENS)
        await reserve(budgets, TOKENS, request_id="dead")

    run(dead_call)
    sync_redis().srem(HOLDING, SCHEMA)  # as a hold made before HOLDING was kept
    sync_redis().delete(HOLDING_COMPLETE)
    assert sweep_all(sync_redis(), lambda: ["other_schema", SCHEMA], now=late) == 1  # found by the walk
    assert sync_redis().exists(HOLDING_COMPLETE)

    def every_schema() -> list[str]:
        raise AssertionError("every tenant walked again")

    run(dead_call)
    assert sweep_all(sync_redis(), every_schema, now=late) == 1  # found through HOLDING
    assert sync_redis().hgetall(budget_key(SCHEMA, TOKENS, NOW)) == {b"spent": b"0", b"reserved": b"0"}
    assert not sync_redis().sismember(HOLDING, SCHEMA)


def test_prices_become_whole_nano_dollars_rounded_up() -> None:
    from decimal import Decimal

    assert nano_per_token(Decimal("0.15")) == 150
    assert nano_per_token(Decimal("2.5")) == 2500
    assert nano_per_token(Decimal("0.0001")) == 1


def test_a_call_for_several_replies_holds_each_replys_tokens() -> None:
    async def work(budgets: Budgets) -> None:
        await started(budgets, TOKENS)
        held = await budgets.reserve(
            schema=SCHEMA,
            epoch="0",
            request_id="n3",
            budgets=(TOKENS,),
            prompt_tokens=10,
            max_tokens=40,
            replies=3,
            price_in=1000,
            price_out=2000,
            now=NOW,
        )
        assert held.max_tokens == 30  # (100 - 10) / 3 each
        assert await budgets.counters(held.keys[0]) == (0, 100)

    run(work)
