"""Budgets and wallets, enforced across processes by two Redis scripts: reserve before a call, settle after.

Each budget that applies to a call (its user's, its project's, its tenant's) has, per period, one Redis
hash: `spent` (settled) and `reserved` (held by calls in flight), in the budget's unit: tokens, or
nano-USD for budgets in money (a price of 1 USD per million tokens is 1,000 nano-USD a token, so every
cost is a whole number). `reserve` runs in one script, so it is atomic across every gateway process:

- it refuses when a budget cannot pay for the prompt and one token of reply;
- otherwise it lowers the reply's `max_tokens` to what every budget can still pay for, and holds the
  call's largest possible cost (prompt plus that many tokens) in each budget.

A call can then spend more than it reserved only where the prompt's estimate fell short, so a budget is
overspent by less than one call's maximum cost however many calls run at once, and no call is refused
while a budget has room for it. `settle` turns the hold into the call's real cost. The script also checks
the tenant's epoch (bumped on every change to tokens, users, budgets or the gateway's configuration), so
the gateway can cache who a token is without missing a revocation.

A budget's counters start from the usage table when their key is missing (a new period, or Redis lost
its data): the ledger is the truth, Redis the fast copy. Holds of calls whose process died are released
by `sweep` (Celery beat) once they are older than any call could run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

NANO_PER_USD = 10**9
HOLD_MAX_AGE = 2 * 3600  # seconds: longer than the longest call a deployment's timeout allows

_RESERVE = """
local epoch = redis.call('GET', KEYS[1]) or '0'
if epoch ~= ARGV[1] then return {'stale', epoch} end
local n = tonumber(ARGV[4])
local out = tonumber(ARGV[5])
for i = 1, n do
  local key = KEYS[2 + i]
  if redis.call('EXISTS', key) == 0 then return {'missing', tostring(i)} end
  local limit = tonumber(ARGV[3 + 3 * i])
  local fixed = tonumber(ARGV[4 + 3 * i])
  local per_out = tonumber(ARGV[5 + 3 * i])
  local spent = tonumber(redis.call('HGET', key, 'spent') or '0')
  local reserved = tonumber(redis.call('HGET', key, 'reserved') or '0')
  local room = limit - spent - reserved - fixed
  if room < per_out or room < 0 then
    return {'exhausted', tostring(i), string.format('%.0f', spent), string.format('%.0f', reserved)}
  end
  if per_out > 0 then
    local fits = math.floor(room / per_out)
    if fits < out then out = fits end
  end
end
local holds = {}
local keys = {}
for i = 1, n do
  local hold = tonumber(ARGV[4 + 3 * i]) + tonumber(ARGV[5 + 3 * i]) * out
  redis.call('HINCRBY', KEYS[2 + i], 'reserved', string.format('%.0f', hold))
  holds[i] = string.format('%.0f', hold)
  keys[i] = KEYS[2 + i]
end
local hold = ARGV[3] .. '|' .. table.concat(holds, ',') .. '|' .. table.concat(keys, ',')
redis.call('HSET', KEYS[2], ARGV[2], hold)
redis.call('SADD', KEYS[3 + n], ARGV[6 + 3 * n])
return {'ok', tostring(out)}
"""

_SETTLE = """
local entry = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
local holds = {}
if entry then
  local list = string.match(entry, '^[^|]*|([^|]*)')
  for hold in string.gmatch(list, '[^,]+') do table.insert(holds, hold) end
end
for i = 1, #KEYS - 1 do
  local key = KEYS[1 + i]
  if redis.call('EXISTS', key) == 1 then
    if holds[i] then redis.call('HINCRBY', key, 'reserved', '-' .. holds[i]) end
    redis.call('HINCRBY', key, 'spent', ARGV[1 + i])
  end
end
return #holds
"""

_RELEASE = """
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local list = string.match(entry, '^[^|]*|([^|]*)')
local i = 0
for hold in string.gmatch(list, '[^,]+') do
  i = i + 1
  if KEYS[1 + i] and redis.call('EXISTS', KEYS[1 + i]) == 1 then
    redis.call('HINCRBY', KEYS[1 + i], 'reserved', '-' .. hold)
  end
end
return i
"""


@dataclass(frozen=True)
class Budget:
    """One budget as the gateway enforces it: `limit` in tokens, or in nano-USD for unit "usd"."""

    id: str
    label: str  # "project apollo's monthly budget", for refusals
    unit: str  # "tokens" or "usd"
    limit: int
    period: str  # "day", "week", "month", or "none" for a wallet

    def window(self, now: datetime) -> date | None:
        return period_start(self.period, now)

    def cost(self, tokens_in: int, tokens_out: int, price_in: int, price_out: int) -> int:
        """What a call costs in this budget's unit (prices in nano-USD per token)."""
        if self.unit == "tokens":
            return tokens_in + tokens_out
        return tokens_in * price_in + tokens_out * price_out


def period_start(period: str, now: datetime) -> date | None:
    today = now.astimezone(UTC).date()
    if period == "day":
        return today
    if period == "week":
        return today - timedelta(days=today.weekday())
    if period == "month":
        return today.replace(day=1)
    return None


def period_end(period: str, start: date | None) -> date | None:
    if start is None:
        return None
    if period == "day":
        return start + timedelta(days=1)
    if period == "week":
        return start + timedelta(days=7)
    return (start.replace(day=28) + timedelta(days=4)).replace(day=1)


def nano_per_token(price_per_million: Decimal) -> int:
    """USD per million tokens as nano-USD per token, rounded up so a budget never undercounts."""
    return math.ceil(price_per_million * 1000)


def usd(nano: int) -> Decimal:
    return Decimal(nano) / NANO_PER_USD


def budget_key(schema: str, budget: Budget, now: datetime) -> str:
    window = budget.window(now)
    return f"kq:gw:{schema}:budget:{budget.id}:{window.isoformat() if window else 'all'}"


def epoch_key(schema: str) -> str:
    return f"kq:gw:{schema}:epoch"


def holds_key(schema: str) -> str:
    return f"kq:gw:{schema}:holds"


# The schemas that may hold budget holds: a reservation adds its schema in the script that makes its hold,
# and the sweep takes a schema away only when it has none left, in one script. So the sweep visits the
# tenants that called the gateway lately, not every tenant.
HOLDING = "kq:gw:holding"
# Set once a sweep has walked every tenant: holds made before HOLDING was kept are found then.
HOLDING_COMPLETE = "kq:gw:holding:complete"

_FORGET = """
if redis.call('HLEN', KEYS[1]) == 0 then return redis.call('SREM', KEYS[2], ARGV[1]) end
return 0
"""


@dataclass(frozen=True)
class Reserved:
    max_tokens: int
    keys: tuple[str, ...]


class Stale(Exception):
    """The tenant's epoch moved: what the gateway cached about this token may be out of date."""


class Missing(Exception):
    def __init__(self, budget: Budget, key: str) -> None:
        super().__init__(budget.id)
        self.budget = budget
        self.key = key


class Exhausted(Exception):
    def __init__(self, budget: Budget, spent: int, reserved: int) -> None:
        self.budget = budget
        self.spent = spent
        self.reserved = reserved
        super().__init__(self.sentence())

    def sentence(self) -> str:
        def amount(value: int) -> str:
            if self.budget.unit == "tokens":
                return f"{value:,} tokens"
            return f"{usd(value):.9f}".rstrip("0").rstrip(".") + " USD"

        period = "" if self.budget.period == "none" else f" this {self.budget.period}"
        held = f" ({amount(self.reserved)} more held by calls in flight)" if self.reserved else ""
        later = "" if self.budget.period == "none" else f", or wait for the next {self.budget.period}"
        spent, limit = amount(self.spent), amount(self.budget.limit)
        return (
            f"No room left in {self.budget.label}{period}: {spent} of {limit} spent{held}. "
            f"Ask a tenant admin to raise it or top it up{later}."
        )


class Budgets:
    """The two scripts, bound to one Redis client (redis.asyncio)."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)
        self._release = redis.register_script(_RELEASE)

    async def reserve(
        self,
        *,
        schema: str,
        epoch: str,
        request_id: str,
        budgets: tuple[Budget, ...],
        prompt_tokens: int,
        max_tokens: int,
        price_in: int,
        price_out: int,
        now: datetime,
        replies: int = 1,
    ) -> Reserved:
        """Hold the call's largest cost; `max_tokens` is per reply, and the call may ask for `replies`."""
        keys = tuple(budget_key(schema, budget, now) for budget in budgets)
        arguments: list[Any] = [epoch, request_id, int(time.time()), len(budgets), max_tokens]
        for budget in budgets:
            fixed = budget.cost(prompt_tokens, 0, price_in, price_out)
            per_out = budget.cost(0, replies, price_in, price_out)  # one more token in every reply
            arguments += [budget.limit, fixed, per_out]
        arguments.append(schema)
        result = await self._reserve(
            keys=[epoch_key(schema), holds_key(schema), *keys, HOLDING], args=arguments
        )
        status = result[0].decode() if isinstance(result[0], bytes) else result[0]
        if status == "ok":
            return Reserved(max_tokens=int(result[1]), keys=keys)
        if status == "stale":
            raise Stale
        index = int(result[1]) - 1
        if status == "missing":
            raise Missing(budgets[index], keys[index])
        raise Exhausted(budgets[index], int(result[2]), int(result[3]))

    async def settle(self, *, schema: str, request_id: str, keys: tuple[str, ...], costs: list[int]) -> None:
        await self._settle(keys=[holds_key(schema), *keys], args=[request_id, *costs])

    async def release(self, *, schema: str, request_id: str, keys: tuple[str, ...]) -> None:
        """Drop a hold without spending (the call was refused or failed before any tokens were made)."""
        await self._release(keys=[holds_key(schema), *keys], args=[request_id])

    async def start(self, key: str, spent: int, budget: Budget, now: datetime) -> None:
        """Start a budget's counters for its period at what the ledger says was spent."""
        end = period_end(budget.period, budget.window(now))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, "spent", spent)
            pipe.hsetnx(key, "reserved", 0)
            if end is not None:
                expire_at = datetime.combine(end, datetime.min.time(), tzinfo=UTC) + timedelta(days=7)
                pipe.expireat(key, int(expire_at.timestamp()))
            await pipe.execute()

    async def counters(self, key: str) -> tuple[int, int] | None:
        values = await self.redis.hmget(key, "spent", "reserved")
        if values[0] is None:
            return None
        return int(values[0]), int(values[1] or 0)


def sweep(redis: Any, schema: str, *, now: float | None = None) -> int:
    """Release holds older than HOLD_MAX_AGE (their process died mid-call); returns how many. A schema
    left with no hold leaves HOLDING.

    A hold reads `<unix time>|<amounts>|<budget keys>`, so it says where to give its amounts back."""
    cutoff = (now or time.time()) - HOLD_MAX_AGE
    release = redis.register_script(_RELEASE)
    released = 0
    for request_id, entry in redis.hscan_iter(holds_key(schema)):
        started, _, keys = entry.decode().split("|")
        if int(started) < cutoff:
            released += bool(release(keys=[holds_key(schema), *keys.split(",")], args=[request_id]))
    redis.register_script(_FORGET)(keys=[holds_key(schema), HOLDING], args=[schema])
    return released


def sweep_all(redis: Any, every_schema: Callable[[], list[str]], *, now: float | None = None) -> int:
    """Sweep the schemas in HOLDING; the first time, every schema (`every_schema`), since holds made
    before HOLDING was kept are not in it. How many holds were released."""
    if redis.exists(HOLDING_COMPLETE):
        schemas = [schema.decode() for schema in redis.sscan_iter(HOLDING)]
    else:
        schemas = every_schema()
    released = sum(sweep(redis, schema, now=now) for schema in schemas)
    redis.set(HOLDING_COMPLETE, 1)
    return released
