"""The replay that the trace benchmark and `klique simulate` run."""

from __future__ import annotations

import pytest

from apps.scheduling.engine import Policy, Pool, Profile, Queue, units
from apps.scheduling.engine.simulate import Job, Setup, replay, with_limits_at_reservations

HOUR = 3600.0


def two_groups() -> Setup:
    return Setup(
        "two groups",
        (Pool("p", units(8)),),
        (Profile("any", ("p",)),),
        (Policy("dev", units(4), units(8)), Policy("research", units(4), units(8))),
        (Queue("dev-q", "dev", "any"), Queue("research-q", "research", "any")),
    )


def test_borrowing_then_reclaim_in_simulated_time() -> None:
    jobs = [
        # Dev fills the pool at t=0 for 10 hours (borrowing 4 GPUs), Research arrives at t=1h.
        Job("dev-1", "dev-q", 0.0, 10 * HOUR, units(4), "dev"),
        Job("dev-2", "dev-q", 0.0, 10 * HOUR, units(4), "dev"),
        Job("research-1", "research-q", HOUR, 2 * HOUR, units(4), "research"),
    ]
    outcome = replay(two_groups(), jobs, interval=60.0)
    assert outcome.finished == 3
    assert outcome.preemptions == 1  # one of Dev's borrowed jobs gives way
    assert outcome.reservation_violation_seconds == 0
    assert max(outcome.waits) == pytest.approx(0.0, abs=60.0)  # research starts within one cycle
    # All work is done and nothing is lost: 2 x 10 h x 4 GPUs + 2 h x 4 GPUs of GPU time.
    assert outcome.gpu_unit_seconds == pytest.approx(units(4) * (20 + 2) * HOUR, rel=1e-6)


def test_without_borrowing_the_pool_idles_and_jobs_wait() -> None:
    jobs = [Job(f"dev-{i}", "dev-q", 0.0, HOUR, units(4), "dev") for i in range(2)]
    free = replay(two_groups(), jobs, interval=60.0)
    strict = replay(with_limits_at_reservations(two_groups(), "strict"), jobs, interval=60.0)
    assert max(free.waits) == 0
    assert max(strict.waits) == pytest.approx(HOUR, abs=60.0)
    assert free.mean_completion_time < strict.mean_completion_time


def test_a_job_larger_than_every_pool_is_refused() -> None:
    outcome = replay(two_groups(), [Job("huge", "dev-q", 0.0, HOUR, units(16), "dev")])
    assert (outcome.jobs, outcome.refused, outcome.finished) == (1, 1, 0)
