"""A task alike to one just refused for room, with nothing changed in the cycle since, is refused as that one
was without asking again (engine/cycle.py, _refused_as_before and _settle): the decisions are the same as when
every task is asked in full, on random snapshots small and large, and the cases where an alike task must
still be asked are each pinned by a rule."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings

from apps.scheduling.engine import Decision, Sharing, Snapshot, Task, schedule, units
from apps.scheduling.engine.cycle import _Cycle
from tests.scheduling.builders import policy, pool, profile, queue, running, snapshot, task
from tests.scheduling.test_engine_invariants import check_queue_order
from tests.scheduling.test_engine_invariants import snapshots as random_snapshots


def outcome(decision: Decision) -> tuple[object, ...]:
    return (
        sorted((placement.task, placement.pool) for placement in decision.placements),
        sorted((item.victim, item.pool, item.for_task) for item in decision.preemptions),
        decision.reasons,
        decision.planned,
    )


def asked_in_full(state: Snapshot, monkeypatch: pytest.MonkeyPatch) -> Decision:
    with monkeypatch.context() as patch:
        patch.setattr(_Cycle, "remember_refusals", False)
        return schedule(state)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(state=random_snapshots(uniform=False))
def test_the_same_decision_as_asking_every_task_on_random_snapshots(
    state: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert outcome(schedule(state)) == outcome(asked_in_full(state, monkeypatch))


@pytest.mark.parametrize("seed", range(4))
def test_the_same_decision_on_long_queues_of_alike_tasks(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty queues of a hundred tasks of four kinds on pools mostly full, some with time limits, some
    profiles starving their heads: most refusals are remembered ones, and nothing differs."""
    rng = random.Random(seed)
    pools = [pool(f"p{i}", 8, sharing=(Sharing.FRACTION,) if i % 2 else ()) for i in range(6)]
    profiles = [
        profile(f"prof{i}", rng.sample([p.id for p in pools], 3), starvation=rng.choice([None, 500.0]))
        for i in range(5)
    ]
    policies = [policy(f"team{i}", rng.randint(0, 12), 24) for i in range(4)]
    queues = [queue(f"q{i}", f"team{i % 4}", f"prof{i % 5}", rng.randint(0, 2)) for i in range(20)]
    kinds = [(units(1), Sharing.WHOLE), (units(2), Sharing.WHOLE), (units("0.5"), Sharing.FRACTION)]
    queued = []
    for i in range(2000):
        size, sharing = rng.choice(kinds)
        at, priority, limit = rng.uniform(0, 1000), rng.randint(0, 1), rng.choice([None, None, 1800.0])
        queued.append(Task(f"t{i}", f"q{rng.randrange(20)}", size, at, sharing, priority, limit))
    allocations = [
        running(f"r{i}", f"q{i % 20}", f"p{i % 6}", 1, ends=rng.choice([None, 2000.0])) for i in range(44)
    ]
    state = snapshot(
        pools=pools,
        profiles=profiles,
        policies=policies,
        queues=queues,
        queued=queued,
        allocations=allocations,
    )
    remembered = 0
    as_before = _Cycle._refused_as_before

    def counting(self: _Cycle, *args: object) -> bool:
        nonlocal remembered
        answer = as_before(self, *args)  # type: ignore[arg-type]
        remembered += answer
        return answer

    with monkeypatch.context() as patch:
        patch.setattr(_Cycle, "_refused_as_before", counting)
        decision = schedule(state)
    assert remembered > 500
    assert outcome(decision) == outcome(asked_in_full(state, monkeypatch))


def test_a_starving_task_behind_an_alike_refusal_still_holds_its_pool() -> None:
    """`recent` and `old` are alike (4 GPUs, no limit) and both find no room in x (2 free), nothing changing
    between them; but `old` has waited past the bound, and at its turn as head it holds x, which keeps
    `small` out."""
    decision = schedule(
        snapshot(
            pools=[pool("x", 8)],
            profiles=[profile("prof", ["x"], starvation=300.0)],
            policies=[policy("team", 0, 16)],
            queues=[queue("q", "team", "prof"), queue("r", "team", "prof")],
            queued=[
                task("recent", "q", 4, at=900.0, priority=1),
                task("old", "q", 4, at=0.0),
                task("small", "r", 1, at=960.0),
            ],
            allocations=[running("busy", "r", "x", 6)],
        )
    )
    assert decision.placements == ()
    assert decision.reasons["small"].code == "capacity_held"
    assert "old" in decision.reasons["small"].message


def test_a_time_limit_makes_another_kind() -> None:
    """`unlimited` and `short` are alike but for their time limits: the pool is reserved for the blocked
    head, `unlimited` would delay it, `short` ends in time and goes."""
    now, hour = 1000.0, 3600.0
    decision = schedule(
        snapshot(
            pools=[pool("p", 8)],
            profiles=[profile("prof", ["p"])],
            policies=[policy("t", 0, 16)],
            queues=[queue("q", "t", "prof"), queue("r", "t", "prof")],
            queued=[
                task("head", "q", 8, at=1.0),
                task("unlimited", "r", 1, at=2.0),
                task("short", "r", 1, at=3.0, limit=hour / 2),
            ],
            allocations=[running("a", "q", "p", 6, ends=now + hour)],
            now=now,
        )
    )
    assert {placement.task for placement in decision.placements} == {"short"}
    assert decision.reasons["unlimited"].code == "reserved_for_head"


def test_settling_asks_an_alike_task_again_once_something_has_changed() -> None:
    """`a1` and `a2` are alike, `a1` first in its queue. When settling comes to `a1`, pool P is held for the
    starving `T`, so `a1` finds no room. `T` then reclaims the newer of Team B's runs in P (borrowing in pool
    Q made Team B's work in P reclaimable) and leaves a GPU free beside it. Before `a2` is asked, `a1` is
    asked again, since the cycle has changed: it takes that GPU, and `a2` waits behind it."""
    state = snapshot(
        pools=[pool("P", 4), pool("Q", 4)],
        profiles=[profile("fa", ["P"]), profile("ft", ["P"], starvation=100.0), profile("fb", ["Q"])],
        policies=[policy("A", 2, 2), policy("B", 4, 8), policy("C", 2, 2)],
        queues=[queue("qa", "A", "fa"), queue("qt", "C", "ft"), queue("qb", "B", "fb")],
        queued=[
            task("a1", "qa", 1, at=500.0, priority=2),
            task("T", "qt", 2, at=0.0, priority=1),
            task("a2", "qa", 1, at=500.0),
            task("b1", "qb", 3, at=0.0),
        ],
        allocations=[
            running("v1", "qb", "P", 3, started=200.0),
            running("v2", "qb", "P", 1, started=100.0),
        ],
    )
    decision = schedule(state)
    check_queue_order(state, decision)
    assert {(placement.task, placement.pool) for placement in decision.placements} == {
        ("b1", "Q"),
        ("T", "P"),
        ("a1", "P"),
    }
    assert [(item.victim, item.for_task) for item in decision.preemptions] == [("v1", "T")]
    assert decision.reasons["a2"].code == "no_capacity"
