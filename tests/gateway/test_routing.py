"""Routing without I/O: strategies, cooldowns and fallbacks, on a clock and random source the test drives."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from gateway.config import parse
from gateway.routing import NoDeployment, Router


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def router(strategy: str = "simple-shuffle", **settings: Any) -> tuple[Router, Clock]:
    def deployment(name: str, model: str, weight: float = 1) -> dict[str, Any]:
        return {
            "model_name": name,
            "litellm_params": {"model": f"openai/{model}", "api_base": "http://up/v1", "weight": weight},
        }

    document = {
        "model_list": [deployment("chat", "a", 3), deployment("chat", "b", 1), deployment("backup", "c")],
        "router_settings": {"routing_strategy": strategy, **settings},
    }
    clock = Clock()
    return Router(parse(document), clock=clock, rng=random.Random(7)), clock


def first(r: Router, group: str = "chat") -> str:
    return next(r.plan(group)).model


def test_simple_shuffle_follows_the_weights() -> None:
    r, _ = router()
    picks = Counter(first(r) for _ in range(4000))
    assert 0.70 < picks["a"] / 4000 < 0.80  # weight 3 of 4


def test_least_busy_takes_the_deployment_with_fewest_calls_in_flight() -> None:
    r, _ = router("least-busy")
    a, b = r.config.group("chat")
    r.started(a)
    r.started(a)
    r.started(b)
    assert {first(r) for _ in range(50)} == {"b"}
    r.started(b)
    r.started(b)
    assert {first(r) for _ in range(50)} == {"a"}


def test_latency_based_routing_measures_each_then_prefers_the_fastest() -> None:
    r, clock = router("latency-based-routing")
    a, b = r.config.group("chat")
    assert {first(r) for _ in range(50)} == {"a", "b"}  # nothing measured yet: either
    for deployment, seconds in ((a, 0.5), (b, 0.1)):
        started = r.started(deployment)
        clock.now += seconds
        r.succeeded(deployment, started)
    assert {first(r) for _ in range(50)} == {"b"}


def test_a_deployment_cools_down_after_its_allowed_failures_then_returns() -> None:
    r, clock = router(allowed_fails=2, cooldown_time=30, num_retries=1)
    a, b = r.config.group("chat")
    for _ in range(2):
        r.started(a)
        r.failed(a)
    assert [d.model for d in r.plan("chat")] == ["b"]
    r.started(b)
    r.failed(b)
    r.started(b)
    r.failed(b)
    with pytest.raises(NoDeployment) as none:
        list(r.plan("chat"))
    assert none.value.retry_after == 30
    assert "retry in 30 s" in str(none.value)
    clock.now += 31
    assert sorted(d.model for d in r.plan("chat")) == ["a", "b"]


def test_failures_older_than_a_minute_do_not_count() -> None:
    r, clock = router(allowed_fails=2)
    a, _ = r.config.group("chat")
    r.started(a)
    r.failed(a)
    clock.now += 61
    r.started(a)
    r.failed(a)
    assert "a" in {d.model for d in r.available("chat")}


def test_retries_stay_in_the_group_then_fallbacks_follow_in_order() -> None:
    r, _ = router(num_retries=1, fallbacks=[{"chat": ["backup"]}])
    assert sorted(d.model for d in r.plan("chat"))[:2] == ["a", "b"]
    assert [d.model for d in r.plan("chat")][-1] == "c"
    r0, _ = router(num_retries=0, fallbacks=[{"chat": ["backup"]}])
    assert len([d.model for d in r0.plan("chat")]) == 2  # one of chat's, then backup's
