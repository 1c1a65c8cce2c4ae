"""Each rule of the scheduling contract, with a small worked example."""

from __future__ import annotations

import random
from dataclasses import replace
from fractions import Fraction
from typing import Any

import pytest

from apps.scheduling.engine import (
    Placement,
    Preemption,
    Sharing,
    SizeError,
    describe,
    mig_fraction,
    schedule,
    units,
)
from tests.scheduling.builders import policy, pool, profile, queue, running, snapshot, task


def placed(decision) -> dict[str, str]:
    return {placement.task: placement.pool for placement in decision.placements}


# -- accounting ----------------------------------------------------------------------------------------


def test_sizes_are_exact_units() -> None:
    assert units("0.25") == 210
    assert units(Fraction(1, 7)) == 120
    assert units(8) == 8 * 840
    assert sum([units(Fraction(1, 7))] * 7) == units(1)
    with pytest.raises(SizeError, match="cannot be counted exactly"):
        units("0.001")
    with pytest.raises(SizeError, match="not a number"):
        units("lots")
    assert mig_fraction("1g.10gb") == Fraction(1, 7)
    assert mig_fraction("3g.40gb", "H100") == Fraction(3, 7)
    assert mig_fraction("1g.6gb", "A30") == Fraction(1, 4)
    with pytest.raises(SizeError, match="not a MIG profile"):
        mig_fraction("half")
    assert [describe(units(x)) for x in (8, 1, "0.25", Fraction(3, 7))] == [
        "8 GPUs",
        "1 GPU",
        "0.25 GPU",
        "3/7 GPU",
    ]


def test_fractions_and_mig_slices_fill_a_gpu_exactly() -> None:
    shared = pool("shared", 1, sharing=[Sharing.FRACTION, Sharing.MIG])
    quarters = [task(f"q{i}", "cr", "0.25", at=i, sharing=Sharing.FRACTION) for i in range(5)]
    decision = schedule(
        snapshot(
            pools=[shared],
            profiles=[profile("p", ["shared"])],
            policies=[policy("team", 1, 1)],
            queues=[queue("cr", "team", "p")],
            queued=quarters,
        )
    )
    assert sorted(placed(decision)) == ["q0", "q1", "q2", "q3"]
    assert decision.reasons["q4"].code == "policy_limit"

    sevenths = [task(f"m{i}", "cr", Fraction(1, 7), at=i, sharing=Sharing.MIG) for i in range(8)]
    decision = schedule(
        snapshot(
            pools=[shared],
            profiles=[profile("p", ["shared"])],
            policies=[policy("team", 2, 2)],
            queues=[queue("cr", "team", "p")],
            queued=sevenths,
        )
    )
    assert len(decision.placements) == 7
    assert decision.reasons["m7"].code == "no_capacity"


def test_a_fraction_never_goes_to_a_pool_without_sharing() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("whole-only", 8), pool("shared", 2, sharing=[Sharing.FRACTION])],
            profiles=[profile("p", ["whole-only", "shared"])],
            policies=[policy("team", 8, 8)],
            queues=[queue("cr", "team", "p")],
            queued=[task("t", "cr", "0.5", sharing=Sharing.FRACTION)],
        )
    )
    assert placed(decision) == {"t": "shared"}


def test_a_multi_node_task_is_never_split_across_pools() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("a", 8), pool("b", 8), pool("big", 32)],
            profiles=[profile("p", ["a", "b", "big"])],
            policies=[policy("team", 16, 64)],
            queues=[queue("cr", "team", "p")],
            queued=[task("2x8", "cr", 16)],
            allocations=[running("r", "cr", "big", 24)],
        )
    )
    assert placed(decision) == {}
    assert decision.reasons["2x8"].code == "no_capacity"
    assert "16 GPUs" in decision.reasons["2x8"].message


# -- pool order ----------------------------------------------------------------------------------------


def test_the_first_online_pool_with_room_in_the_profile_s_order() -> None:
    base = snapshot(
        pools=[pool("baremetal", 4), pool("h100", 8, online=False), pool("cloud", 16)],
        profiles=[profile("p", ["baremetal", "h100", "cloud"])],
        policies=[policy("team", 16, 16)],
        queues=[queue("cr", "team", "p")],
        queued=[task("a", "cr", 4, at=1), task("b", "cr", 4, at=2)],
    )
    assert placed(schedule(base)) == {"a": "baremetal", "b": "cloud"}


def test_offline_everywhere_is_explained() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("x", 8, online=False)],
            profiles=[profile("p", ["x"])],
            policies=[policy("team", 8, 8)],
            queues=[queue("cr", "team", "p")],
            queued=[task("t", "cr", 1)],
        )
    )
    assert decision.reasons["t"].code == "no_pool_can_hold"
    assert "offline" in decision.reasons["t"].message


# -- limits and shares ---------------------------------------------------------------------------------


def test_a_policy_never_exceeds_its_limit() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("x", 64)],
            profiles=[profile("p", ["x"])],
            policies=[policy("team", 8, 16)],
            queues=[queue("cr", "team", "p")],
            queued=[task("a", "cr", 8, at=1), task("b", "cr", 8, at=2), task("c", "cr", 8, at=3)],
        )
    )
    assert sorted(placed(decision)) == ["a", "b"]
    assert decision.reasons["c"].code == "policy_limit"
    assert decision.reasons["c"].message == (
        "Policy team is at its limit of 16 GPUs: it uses 16 GPUs and this task needs 8 GPUs."
    )


def test_the_tenant_never_exceeds_its_share() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("x", 64)],
            profiles=[profile("p", ["x"])],
            policies=[policy("a", 16, 32), policy("b", 16, 32)],
            queues=[queue("qa", "a", "p"), queue("qb", "b", "p")],
            queued=[task("a1", "qa", 8), task("b1", "qb", 8)],
            allocations=[running("r", "qa", "x", 4)],
            share=16,
        )
    )
    assert len(decision.placements) == 1
    waiting = next(reason for reason in decision.reasons.values())
    assert waiting.code == "tenant_share"


# -- order ---------------------------------------------------------------------------------------------


def test_guaranteed_work_goes_before_borrowing_whatever_the_queuing_priority() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("x", 8)],
            profiles=[profile("p", ["x"])],
            policies=[policy("vip", 0, 8), policy("research", 8, 8)],
            queues=[queue("vip-q", "vip", "p", priority=100), queue("research-q", "research", "p")],
            queued=[task("vip-job", "vip-q", 8, at=1), task("research-job", "research-q", 8, at=2)],
        )
    )
    assert placed(decision) == {"research-job": "x"}
    assert decision.reasons["vip-job"].code == "no_capacity"


def test_within_a_band_queuing_priority_then_task_priority_then_fair_share_then_submit_time() -> None:
    def first_of(**changes: Any) -> str:
        defaults: dict[str, Any] = {
            "pools": [pool("x", 1)],
            "profiles": [profile("p", ["x"])],
            "policies": [policy("a", 0, 8), policy("b", 0, 8)],
            "queues": [queue("qa", "a", "p"), queue("qb", "b", "p")],
            "queued": [task("ta", "qa", 1, at=2), task("tb", "qb", 1, at=1)],
        }
        defaults.update(changes)
        return next(iter(placed(schedule(snapshot(**defaults)))))

    assert first_of() == "tb"  # earlier submit time
    assert first_of(queues=[queue("qa", "a", "p", priority=1), queue("qb", "b", "p")]) == "ta"
    assert first_of(queued=[task("ta", "qa", 1, at=2, priority=5), task("tb", "qb", 1, at=1)]) == "ta"
    # Fair share: b already uses what it has, a uses nothing; a goes first.
    fair = first_of(
        pools=[pool("x", 1), pool("y", 4)],
        profiles=[profile("p", ["x"]), profile("py", ["y"])],
        policies=[policy("a", 2, 8), policy("b", 2, 8)],
        queues=[queue("qa", "a", "p"), queue("qb", "b", "p"), queue("qb-y", "b", "py")],
        allocations=[running("busy", "qb-y", "y", 2)],
    )
    assert fair == "ta"


def test_execution_priority_decides_between_profiles_competing_for_a_pool() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("x", 4)],
            profiles=[
                profile("train", ["x"], execution={"x": 1}),
                profile("infer", ["x"], execution={"x": 9}),
            ],
            policies=[policy("team", 0, 8)],
            queues=[queue("q-train", "team", "train"), queue("q-infer", "team", "infer")],
            queued=[task("train-job", "q-train", 4, at=1), task("infer-job", "q-infer", 4, at=2)],
        )
    )
    assert placed(decision) == {"infer-job": "x"}


# -- queue discipline ----------------------------------------------------------------------------------


def discipline(*, strict: bool, starvation: float | None = None, head_at: float = 990.0):
    return snapshot(
        pools=[pool("x", 8), pool("y", 8)],
        profiles=[profile("p", ["x", "y"], strict=strict, starvation=starvation)],
        policies=[policy("team", 16, 16)],
        queues=[queue("cr", "team", "p")],
        queued=[task("big", "cr", 8, at=head_at), task("small", "cr", 2, at=995.0)],
        allocations=[running("r1", "cr", "x", 4, started=1), running("r2", "cr", "y", 1, started=1)],
        now=1000.0,
    )


def test_strict_fifo_places_nothing_behind_a_head_that_cannot_go() -> None:
    decision = schedule(discipline(strict=True))
    assert placed(decision) == {}
    assert decision.reasons["big"].code == "no_capacity"
    assert decision.reasons["small"].code == "strict_fifo"
    assert "big" in decision.reasons["small"].message


def test_best_effort_fifo_lets_smaller_tasks_pass() -> None:
    assert placed(schedule(discipline(strict=False))) == {"small": "x"}


def test_a_starving_head_holds_its_pool() -> None:
    # The head has waited 600 s against a bound of 300 s: x is held for it, small goes to y instead.
    decision = schedule(discipline(strict=False, starvation=300.0, head_at=400.0))
    assert placed(decision) == {"small": "y"}
    assert decision.reasons["big"].code == "no_capacity"


def test_a_head_within_its_bound_holds_nothing() -> None:
    assert placed(schedule(discipline(strict=False, starvation=300.0, head_at=900.0))) == {"small": "x"}


# -- reclaim -------------------------------------------------------------------------------------------


def dev_and_research(research_size: int = 4):
    """Dev and Research, each reservation 8, limit 16; a 4-GPU profile over a bare-metal pool, then H100.
    Dev borrowed 8 GPUs beyond its reservation; Dev's queuing priority is the higher one."""
    return snapshot(
        pools=[pool("baremetal", 8), pool("h100", 8)],
        profiles=[profile("four-gpu", ["baremetal", "h100"])],
        policies=[policy("dev", 8, 16), policy("research", 8, 16)],
        queues=[queue("dev-q", "dev", "four-gpu", priority=10), queue("research-q", "research", "four-gpu")],
        allocations=[
            running("dev-1", "dev-q", "baremetal", 4, started=100),
            running("dev-2", "dev-q", "baremetal", 4, started=300),
            running("dev-3", "dev-q", "h100", 4, started=200),
            running("dev-4", "dev-q", "h100", 4, started=400),
        ],
        queued=[task("research-1", "research-q", research_size, at=500)],
    )


def test_research_under_its_reservation_reclaims_from_dev_s_borrowed_work() -> None:
    decision = schedule(dev_and_research())
    # The first pool of the order; its most recently started victim.
    assert decision.preemptions == (Preemption("dev-2", "baremetal", "research-1"),)
    assert decision.placements == (Placement("research-1", "baremetal"),)


def test_reclaim_never_takes_the_victim_s_policy_below_its_reservation() -> None:
    decision = schedule(dev_and_research(research_size=12))  # beyond research's reservation: borrowing
    assert decision.preemptions == ()
    guaranteed_but_too_big = dev_and_research(research_size=8)
    # 8 GPUs would need both of one pool's Dev tasks; Dev can give up 8 and stay at its reservation.
    decision = schedule(guaranteed_but_too_big)
    assert {p.victim for p in decision.preemptions} == {"dev-1", "dev-2"}
    assert placed(decision) == {"research-1": "baremetal"}


def test_no_useless_preemption() -> None:
    base = dev_and_research(research_size=8)
    # Dev is only 4 above its reservation, and Ops (at its reservation) holds the rest of h100: no pool can
    # free 8 GPUs without taking someone below their reservation, so nobody is preempted at all.
    snap = replace(
        base,
        policies=(*base.policies, policy("ops", 4, 4)),
        queues=(*base.queues, queue("ops-q", "ops", "four-gpu")),
        running=(*base.running[:3], running("ops-1", "ops-q", "h100", 4, started=450)),
    )
    decision = schedule(snap)
    assert decision.preemptions == ()
    assert decision.reasons["research-1"].code == "no_capacity"


def test_borrowing_work_never_preempts() -> None:
    base = dev_and_research()
    snap = replace(base, running=(*base.running, running("research-0", "research-q", "h100", "0.5")))
    snap = replace(
        snap, policies=(replace(snap.policies[0]), replace(snap.policies[1], reservation=units(2)))
    )
    decision = schedule(snap)
    assert decision.preemptions == ()


# -- determinism ---------------------------------------------------------------------------------------


def test_the_same_snapshot_gives_the_same_decision_whatever_the_input_order() -> None:
    snap = dev_and_research()
    snap = replace(
        snap,
        queued=tuple(
            task(f"t{i}", "dev-q" if i % 2 else "research-q", 1 + i % 3, at=i % 5) for i in range(40)
        ),
    )
    first = schedule(snap)
    shuffled = list(snap.queued)
    random.Random(7).shuffle(shuffled)
    again = schedule(replace(snap, queued=tuple(shuffled), running=tuple(reversed(snap.running))))
    assert first == again


def test_every_task_left_queued_has_a_reason() -> None:
    snap = replace(dev_and_research(), queued=tuple(task(f"t{i}", "research-q", 4, at=i) for i in range(10)))
    decision = schedule(snap)
    placed_ids = set(placed(decision))
    assert {t.id for t in snap.queued} == placed_ids | set(decision.reasons)
    assert not placed_ids & set(decision.reasons)


def test_borrowing_that_makes_work_reclaimable_does_not_leave_guaranteed_work_waiting() -> None:
    """Q sits at its reservation with v in pool A; P's guaranteed task needs A, which is full. Once Q
    borrows in pool B, v becomes borrowed work: P's task reclaims it in the same cycle."""
    decision = schedule(
        snapshot(
            pools=[pool("A", 4), pool("B", 2)],
            profiles=[profile("pa", ["A"]), profile("pb", ["B"])],
            policies=[policy("P", 2, 4), policy("Q", 2, 4), policy("R", 2, 2)],
            queues=[
                queue("qp", "P", "pa"),
                queue("qq", "Q", "pb"),
                queue("qqa", "Q", "pa"),
                queue("qr", "R", "pa"),
            ],
            allocations=[running("v", "qqa", "A", 2, started=10), running("r", "qr", "A", 2, started=20)],
            queued=[task("T", "qp", 2, at=100), task("borrow", "qq", 2, at=200)],
        )
    )
    assert placed(decision) == {"T": "A", "borrow": "B"}
    assert decision.preemptions == (Preemption("v", "A", "T"),)


def test_a_guaranteed_placement_of_this_cycle_moves_aside_for_another_policy_s_guaranteed_task() -> None:
    """Found by the reclaim property: Q's first task takes pool A (first in its profile), P's task can only
    use A, then Q borrows B for its second task. Q is now above its reservation, so P's task gets A; Q's
    first task moves into B, and its second, later task is the one that waits (the queue's order holds)."""
    decision = schedule(
        snapshot(
            pools=[pool("A", 1), pool("B", 1)],
            profiles=[profile("either", ["A", "B"]), profile("only-a", ["A"])],
            policies=[policy("P", 1, 1), policy("Q", 1, 2)],
            queues=[queue("qp", "P", "only-a"), queue("qq", "Q", "either")],
            queued=[task("q1", "qq", 1), task("p1", "qp", 1), task("q2", "qq", 1)],
        )
    )
    assert placed(decision) == {"p1": "A", "q1": "B"}
    assert decision.preemptions == ()
    assert decision.reasons["q2"].message  # it waits, saying why


def test_a_borrowing_placement_of_this_cycle_is_taken_back_rather_than_preempted() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("A", 4)],
            profiles=[profile("pa", ["A"], strict=False)],
            policies=[policy("P", 4, 4), policy("Q", 0, 4)],
            queues=[queue("qp", "P", "pa"), queue("qq", "Q", "pa")],
            allocations=[running("q-old", "qq", "A", 2, started=10)],
            queued=[task("big", "qp", 4, at=100), task("small", "qq", 2, at=50)],
        )
    )
    # big (guaranteed) cannot start in band 1 (2 free) and reclaims q-old; small, placed while borrowing,
    # is taken back in the same cycle instead of being started and preempted.
    assert placed(decision) == {"big": "A"}
    assert decision.preemptions == (Preemption("q-old", "A", "big"),)
    assert decision.reasons["small"].code in {"reclaimed", "no_capacity"}


def test_runs_preempted_for_a_placement_that_is_taken_back_serve_the_task_that_takes_its_room() -> None:
    """Found by the invariant property test (hypothesis), kept as it was found. task0 (policy0,
    guaranteed) reclaims policy1's run3 and run4 in pool0; then policy0 borrows in pool1 and rises above
    its reservation, so in settling policy2's guaranteed task1 takes task0's placement back. run3 and run4
    must not stay stopped for task0, which no longer starts: their preemptions now serve task1."""
    mig, fraction = Sharing.MIG, Sharing.FRACTION
    seventh = Fraction(1, 7)
    decision = schedule(
        snapshot(
            pools=[pool("pool0", 1, sharing=[fraction, mig]), pool("pool1", 2, sharing=[mig])],
            profiles=[profile("profile0", ["pool0", "pool1"])],
            policies=[policy("policy0", 2, 3), policy("policy1", 0, 1), policy("policy2", 1, 1)],
            queues=[
                queue("queue0", "policy0", "profile0"),
                queue("queue1", "policy2", "profile0"),
                queue("queue3", "policy1", "profile0"),
                queue("queue4", "policy0", "profile0", priority=1),
            ],
            queued=[
                task("task0", "queue4", "0.5", at=1, sharing=fraction),
                task("task1", "queue1", "0.5", sharing=fraction),
                *(task(f"task{i}", "queue0", seventh, sharing=mig) for i in range(2, 10)),
                task("task10", "queue4", seventh, sharing=mig),
                task("task11", "queue0", 1),
            ],
            allocations=[
                running("run1", "queue0", "pool0", seventh),
                running("run2", "queue0", "pool0", seventh),
                running("run3", "queue3", "pool0", seventh),
                running("run4", "queue3", "pool0", seventh),
                running("run6", "queue0", "pool1", seventh),
            ],
        )
    )
    placements = placed(decision)
    assert placements["task1"] == "pool0"
    assert decision.reasons["task0"].code == "reclaimed"
    assert {p.victim for p in decision.preemptions} >= {"run3", "run4"}
    assert all(p.for_task in placements for p in decision.preemptions)
