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


def one_queue(starvation: float | None = None) -> Setup:
    return Setup(
        "one queue",
        (Pool("p", units(8)),),
        (Profile("any", ("p",), starvation_seconds=starvation),),
        (Policy("all", units(8), units(8)),),
        (Queue("q", "all", "any"),),
    )


def big_behind_small(limits: bool) -> list[Job]:
    """6 GPUs busy for 2 h; an 8-GPU job waits; 1-GPU jobs keep arriving, each an hour long."""
    limit = (lambda hours: hours * HOUR) if limits else (lambda hours: None)
    jobs = [Job("busy", "q", 0.0, 2 * HOUR, units(6), time_limit=limit(2))]
    jobs.append(Job("big", "q", 60.0, HOUR, units(8), time_limit=limit(1)))
    jobs += [
        Job(f"small-{i}", "q", 120.0 + i * 1800.0, HOUR, units(1), time_limit=limit(1)) for i in range(8)
    ]
    return jobs


def test_with_time_limits_small_work_fills_the_gap_and_the_big_job_starts_when_planned() -> None:
    without = replay(one_queue(), big_behind_small(limits=False), interval=60.0)
    backfilled = replay(one_queue(), big_behind_small(limits=True), interval=60.0)
    big_without = next(wait for size, wait in without.sized_waits if size == units(8))
    big_backfilled = next(wait for size, wait in backfilled.sized_waits if size == units(8))
    # Without limits the small jobs keep passing it and it waits on; with them it starts when busy ends.
    assert big_backfilled == pytest.approx(2 * HOUR - 60.0, abs=60.0)
    assert big_without > big_backfilled
    assert backfilled.mean_wait_at_least(units(8)) == big_backfilled
    assert backfilled.finished == without.finished == 10
    assert backfilled.timed_out == 0


def test_a_run_that_reaches_its_time_limit_is_stopped_there() -> None:
    outcome = replay(one_queue(), [Job("long", "q", 0.0, 3 * HOUR, units(2), time_limit=HOUR)], interval=60.0)
    assert outcome.timed_out == 1
    assert outcome.gpu_unit_seconds == pytest.approx(units(2) * HOUR, rel=1e-6)


def test_each_team_s_figures_equal_a_replay_of_its_jobs_alone_when_teams_do_not_meet() -> None:
    """Two teams on pools of their own, never borrowing: each team's waits and GPU time in the shared
    replay are those of a replay of its jobs alone, computed independently here."""
    both = Setup(
        "both",
        (Pool("pa", units(4)), Pool("pb", units(4))),
        (Profile("a", ("pa",)), Profile("b", ("pb",))),
        (Policy("A", units(4), units(4)), Policy("B", units(4), units(4))),
        (Queue("qa", "A", "a"), Queue("qb", "B", "b")),
    )
    jobs = [
        Job(f"{team}-{i}", f"q{team.lower()}", i * 600.0 + offset, (1 + i % 3) * HOUR, units(1 + i % 4), team)
        for team, offset in (("A", 0.0), ("B", 300.0))
        for i in range(12)
    ]
    shared = replay(both, jobs, interval=60.0)
    for team in ("A", "B"):
        alone = Setup(
            team,
            tuple(pool for pool in both.pools if pool.id == f"p{team.lower()}"),
            tuple(profile for profile in both.profiles if profile.id == team.lower()),
            tuple(policy for policy in both.policies if policy.id == team),
            tuple(queue for queue in both.queues if queue.policy == team),
        )
        own = replay(alone, [job for job in jobs if job.group == team], interval=60.0)
        assert sorted(shared.group_waits[team]) == sorted(own.waits)
        assert shared.group_gpu_unit_seconds[team] == pytest.approx(own.gpu_unit_seconds)
        assert shared.group_preemptions[team] == own.preemptions == 0
        assert shared.group_wait_percentile(team, 0.95) == own.wait_percentile(0.95)
