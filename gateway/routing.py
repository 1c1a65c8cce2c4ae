"""Which deployment serves a call: LiteLLM Router's strategies, fallbacks and cooldowns, kept in-process.

The strategies are LiteLLM's, by their names: `simple-shuffle` (random, by `weight`), `least-busy` (fewest
calls in flight) and `latency-based-routing` (lowest moving average of recent latencies, choosing at
random among those within 10% of the best so that one deployment is not flooded). A deployment that
fails `allowed_fails` times within a minute cools down for `cooldown_time` seconds; a call tries up to
`1 + num_retries` deployments of its group, then each fallback group in order.

The state is this process's own (as LiteLLM's Router keeps it without Redis): each web process learns
latencies and failures from the calls it makes. Pure Python, no I/O: the clock and the random source are
parameters so tests can drive them.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gateway.config import Deployment, GatewayConfig

FAILURE_WINDOW = 60.0  # seconds over which failures count towards a cooldown
LATENCY_BUFFER = 0.10  # latency-based routing picks among deployments within 10% of the fastest
LATENCY_ALPHA = 0.3  # weight of the newest sample in the moving average


@dataclass
class _Health:
    in_flight: int = 0
    latency: float | None = None  # moving average, seconds
    failures: deque[float] = field(default_factory=deque)
    cooled_until: float = 0.0


class NoDeployment(Exception):
    """Every deployment the call could use is cooling down, or the model has none."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Router:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng or random.Random()  # noqa: S311 -- load spreading, not secrecy
        self.health: dict[str, _Health] = defaultdict(_Health)

    def available(self, group: str, user_id: str | None = None) -> list[Deployment]:
        now = self.clock()
        return [d for d in self.config.group(group, user_id) if self.health[d.id].cooled_until <= now]

    def pick(self, candidates: list[Deployment]) -> Deployment:
        strategy = self.config.router.routing_strategy
        if len(candidates) == 1:
            return candidates[0]
        if strategy == "least-busy":
            fewest = min(self.health[d.id].in_flight for d in candidates)
            return self.rng.choice([d for d in candidates if self.health[d.id].in_flight == fewest])
        if strategy == "latency-based-routing":
            untried = [d for d in candidates if self.health[d.id].latency is None]
            if untried:  # every deployment is measured before latencies decide
                return self.rng.choice(untried)
            best = min(self.health[d.id].latency or 0.0 for d in candidates)
            close = [
                d for d in candidates if (self.health[d.id].latency or 0.0) <= best * (1 + LATENCY_BUFFER)
            ]
            return self.rng.choice(close)
        return self.rng.choices(candidates, weights=[d.weight for d in candidates])[0]

    def plan(self, group: str, user_id: str | None = None) -> Iterator[Deployment]:
        """The deployments to try for a call to `group` by `user_id`, in order, chosen lazily as earlier
        ones fail."""
        groups = [group, *self.config.router.fallbacks.get(group, ())]
        tried: set[str] = set()
        soonest: float | None = None
        for name in groups:
            for _ in range(1 + self.config.router.num_retries):
                candidates = [d for d in self.available(name, user_id) if d.id not in tried]
                if not candidates:
                    break
                chosen = self.pick(candidates)
                tried.add(chosen.id)
                yield chosen
            cooled = [
                self.health[d.id].cooled_until for d in self.config.group(name, user_id) if d.id not in tried
            ]
            if cooled:
                soonest = min(cooled) if soonest is None else min(soonest, *cooled)
        if not tried:
            wait = None if soonest is None else max(soonest - self.clock(), 0.0)
            raise NoDeployment(
                f"Every deployment of {group!r} and its fallbacks is cooling down after failures; "
                f"retry in {wait or 0:.0f} s.",
                retry_after=wait,
            )

    def started(self, deployment: Deployment) -> float:
        self.health[deployment.id].in_flight += 1
        return self.clock()

    def succeeded(self, deployment: Deployment, started: float) -> None:
        health = self.health[deployment.id]
        health.in_flight -= 1
        elapsed = self.clock() - started
        health.latency = (
            elapsed
            if health.latency is None
            else (LATENCY_ALPHA * elapsed + (1 - LATENCY_ALPHA) * health.latency)
        )

    def failed(self, deployment: Deployment) -> None:
        health = self.health[deployment.id]
        health.in_flight -= 1
        now = self.clock()
        health.failures.append(now)
        while health.failures and health.failures[0] < now - FAILURE_WINDOW:
            health.failures.popleft()
        if len(health.failures) >= self.config.router.allowed_fails:
            health.cooled_until = now + self.config.router.cooldown_time
            health.failures.clear()
