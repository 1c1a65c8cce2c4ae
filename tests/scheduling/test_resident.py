"""Incremental cycles (engine/resident.py): a cycle that decides only the queues a change could move keeps
every invariant of the contract, finds the room that finishes free and serves arrivals as a full cycle
would, leaves the other queues' outcomes (their reasons, holds and planned starts) as they were, and hands
over to a full cycle when it is due."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.scheduling.engine import (
    Allocation,
    Decision,
    Policy,
    Pool,
    Profile,
    Queue,
    Resident,
    Snapshot,
    Task,
    units,
)
from tests.scheduling.test_engine_invariants import check_invariants, snapshots


def at_rest(snapshot: Snapshot) -> Resident:
    """A resident after full cycles until one changes nothing (a cycle's preemptions can open room that
    the next one uses)."""
    resident = Resident(snapshot, full_every=1e9)
    for step in range(20):
        decision = resident.cycle(snapshot.now + step, full=True)
        if not decision.placements and not decision.preemptions:
            return resident
    raise AssertionError("full cycles did not come to rest")


def events(data: st.DataObject, resident: Resident, now: float) -> None:
    """Some running work finishes, some queued work is withdrawn, and some arrives."""
    running = sorted(resident.running)
    resident.finish(data.draw(st.lists(st.sampled_from(running), unique=True, max_size=3)) if running else [])
    queued = sorted(resident.queue_of)
    resident.withdraw(data.draw(st.lists(st.sampled_from(queued), unique=True, max_size=2)) if queued else [])
    queues = sorted(queue.id for queue in resident.config.queues)
    resident.submit(
        Task(
            f"new{now:.0f}-{index}",
            data.draw(st.sampled_from(queues)),
            units(data.draw(st.sampled_from([1, 2]))),
            now,
        )
        for index in range(data.draw(st.integers(0, 4)))
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(uniform=False), st.data())
def test_incremental_cycles_keep_the_invariants(snapshot: Snapshot, data: st.DataObject) -> None:
    resident = Resident(snapshot, full_every=1e9)
    resident.cycle(snapshot.now)
    for step in range(1, 4):
        now = snapshot.now + step
        events(data, resident, now)
        before = resident.snapshot(now)
        decision = resident.cycle(now)
        # Every queued task has a place or a reason: this cycle's, or one kept from an earlier cycle.
        whole = Decision(decision.placements, decision.preemptions, dict(resident.reasons), decision.planned)
        check_invariants(before, whole)
        assert set(resident.reasons) == set(resident.queue_of)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans().flatmap(lambda uniform: snapshots(uniform=uniform)), st.data())
def test_at_rest_an_incremental_cycle_places_what_a_full_one_would(
    snapshot: Snapshot, data: st.DataObject
) -> None:
    resident = at_rest(snapshot)
    now = snapshot.now + 100
    events(data, resident, now)
    full = copy.deepcopy(resident)
    incremental = resident.cycle(now)
    whole = full.cycle(now, full=True)
    assert sorted(incremental.placements, key=str) == sorted(whole.placements, key=str)
    assert sorted(incremental.preemptions, key=str) == sorted(whole.preemptions, key=str)


def two_queues() -> Snapshot:
    """Pools a and b, full; queues qa and qc may use pool a, queue qb pool b; qa and qb have waiting work,
    and qc (a policy of its own) has work running in pool a."""
    pools = (Pool("a", units(4)), Pool("b", units(4)))
    profiles = (
        Profile("pa", ("a",), {}),
        Profile("pb", ("b",), {}),
    )
    policies = tuple(Policy(name, units(0), units(16)) for name in ("pol-a", "pol-b", "pol-c"))
    queues = (Queue("qa", "pol-a", "pa", 1), Queue("qb", "pol-b", "pb", 0), Queue("qc", "pol-c", "pa", 0))
    running = (
        Allocation("rc1", "qc", "a", units(2), 0.0),
        Allocation("ra2", "qa", "a", units(2), 0.0),
        Allocation("rb1", "qb", "b", units(4), 0.0),
    )
    queued = (
        Task("wa1", "qa", units(2), 10.0),
        Task("wa2", "qa", units(4), 11.0),
        Task("wb1", "qb", units(1), 10.0),
    )
    return Snapshot(100.0, pools, profiles, policies, queues, queued, running)


def test_a_finish_decides_only_the_queues_that_can_use_its_room() -> None:
    resident = Resident(two_queues(), full_every=1e9)
    first = resident.cycle(100.0)
    assert first.placements == ()
    assert set(first.reasons) == {"wa1", "wa2", "wb1"}
    kept = resident.reasons["wb1"]

    resident.finish(["rc1"])  # room in pool a, which qa's profile has (qc has nothing waiting)
    assert resident.affected() == {"qa"}
    decision = resident.cycle(101.0)

    assert [(p.task, p.pool) for p in decision.placements] == [("wa1", "a")]
    assert set(decision.reasons) == {"wa2"}  # qb was not decided again ...
    assert resident.reasons["wb1"] is kept  # ... and keeps its reason
    assert set(resident.reasons) == {"wa2", "wb1"}
    assert "wa1" in resident.running
    assert resident.usage.pool_used["a"] == units(4)


def test_a_finish_anywhere_frees_room_under_its_policys_limit() -> None:
    """qa waits for its policy's limit, not for room; work of the same policy finishing in a pool qa does
    not use lets it go."""
    snapshot = Snapshot(
        100.0,
        (Pool("a", units(8)), Pool("b", units(8))),
        (Profile("pa", ("a",), {}), Profile("pb", ("b",), {})),
        (Policy("pol-a", units(0), units(4)),),
        (Queue("qa", "pol-a", "pa"), Queue("qx", "pol-a", "pb")),
        (Task("wa", "qa", units(2), 10.0),),
        (Allocation("ra", "qa", "a", units(2), 0.0), Allocation("rx", "qx", "b", units(2), 0.0)),
    )
    resident = Resident(snapshot, full_every=1e9)
    assert resident.cycle(100.0).reasons["wa"].code == "policy_limit"
    resident.finish(["rx"])
    assert resident.affected() == {"qa"}
    assert [(p.task, p.pool) for p in resident.cycle(101.0).placements] == [("wa", "a")]


def test_an_arrival_is_bound_by_the_hold_of_a_queue_not_decided_again() -> None:
    """A starving head holds its pool; work arriving in another queue that could use the pool's room is
    kept out of it, as a full cycle keeps it out."""
    snapshot = Snapshot(
        100.0,
        (Pool("a", units(4)), Pool("b", units(4))),
        (Profile("pa", ("a",), {}, False, 30.0), Profile("pb", ("b", "a"), {})),
        (Policy("pol-a", units(0), units(16)), Policy("pol-b", units(0), units(16))),
        (Queue("qa", "pol-a", "pa", 1), Queue("qb", "pol-b", "pb", 0)),
        (Task("wa", "qa", units(4), 11.0),),  # has waited past its bound of 30 s
        (Allocation("ra", "qa", "a", units(2), 0.0), Allocation("rb", "qb", "b", units(4), 0.0)),
    )
    resident = Resident(snapshot, full_every=1e9)
    resident.cycle(100.0)
    assert resident.plans.held == {"a": "wa"}  # 2 GPUs free in a, held for wa

    full = copy.deepcopy(resident)
    for each in (resident, full):
        each.submit([Task("late", "qb", units(1), 101.0)])
    assert resident.affected() == {"qb"}
    incremental = resident.cycle(102.0)
    whole = full.cycle(102.0, full=True)

    assert incremental.placements == whole.placements == ()
    assert set(incremental.reasons) == {"late"}  # qa is not decided again: its hold is carried
    assert incremental.reasons["late"] == whole.reasons["late"]
    assert incremental.reasons["late"].code == "capacity_held"
    assert resident.plans.held == {"a": "wa"}


def test_a_full_cycle_runs_when_due() -> None:
    resident = Resident(two_queues(), full_every=30.0)
    resident.cycle(100.0)
    assert resident.last_full == 100.0
    assert set(resident.cycle(110.0).reasons) == set()  # nothing changed: nothing decided
    assert set(resident.cycle(130.0).reasons) == {"wa1", "wa2", "wb1"}  # due: every queue decided
    assert resident.last_full == 130.0


def test_put_tells_a_task_as_it_is_now_and_moves_only_what_changed() -> None:
    """`put` is how rows read back reach a resident: the same task told again changes nothing; a run whose
    times alone changed frees nothing; every other change is a withdrawal, a finish, an arrival or a start."""
    resident = Resident(two_queues(), full_every=1e9)
    resident.cycle(100.0)
    usage = dict(resident.usage.pool_used)

    resident.put("wa1", Task("wa1", "qa", units(2), 10.0))  # as it was
    resident.put("rc1", Allocation("rc1", "qc", "a", units(2), 0.0))  # as it was
    resident.put("unknown", None)  # neither queued nor running, and never seen
    assert resident.affected() == set()
    assert resident.usage.pool_used == usage

    resident.put("rc1", Allocation("rc1", "qc", "a", units(2), 50.0, 900.0))  # started, with a limit
    assert resident.running["rc1"].ends_at == 900.0
    assert resident.affected() == set()  # nothing freed
    assert resident.usage.pool_used == usage

    resident.put("wb1", Task("wb1", "qb", units(1), 10.0, priority=5))  # its priority changed
    assert resident.affected() == {"qb"}
    assert resident.queued["qb"]["wb1"].priority == 5

    resident.put("rb1", None)  # ended
    assert "rb1" not in resident.running
    assert resident.usage.pool_used["b"] == 0
    assert resident.affected() == {"qb"}

    resident.put("wa2", None)  # cancelled while queued
    assert "wa2" not in resident.queue_of
    assert resident.affected() == {"qa", "qb"}

    resident.put("ra2", Allocation("ra2", "qa", "b", units(2), 60.0))  # requeued and placed in pool b
    assert resident.running["ra2"].pool == "b"
    assert resident.usage.pool_used == {"a": units(2), "b": units(2)}

    resident.put("wa1", Allocation("wa1", "qa", "a", units(2), 70.0))  # placed by another worker
    assert "wa1" not in resident.queue_of
    assert resident.usage.pool_used == {"a": units(4), "b": units(2)}

    resident.put("new", Task("new", "qc", units(1), 80.0))  # arrived
    assert resident.queue_of["new"] == "qc"
    resident.put("new", Allocation("new", "qc", "b", units(1), 81.0))
    assert resident.queue_of.get("new") is None
    assert resident.usage.pool_used == {"a": units(4), "b": units(3)}


def test_a_finish_that_brings_a_policy_under_its_reservation_decides_its_other_queues() -> None:
    """Policy P's work in pool a ends; P's queue on pool b had waited as a borrower (P was at its
    reservation) and may now start as guaranteed, taking back the GPUs R borrowed there."""
    snapshot = Snapshot(
        100.0,
        (Pool("a", units(4)), Pool("b", units(4))),
        (Profile("pa", ("a",), {}), Profile("pb", ("b",), {})),
        (Policy("P", units(4), units(16)), Policy("R", units(0), units(16))),
        (Queue("qa", "P", "pa", 0), Queue("qb", "P", "pb", 0), Queue("qr", "R", "pb", 0)),
        (Task("w", "qb", units(2), 10.0),),
        (Allocation("p1", "qa", "a", units(4), 0.0), Allocation("r1", "qr", "b", units(4), 0.0)),
    )
    resident = Resident(snapshot, full_every=1e9)
    first = resident.cycle(100.0)
    assert (first.placements, first.preemptions) == ((), ())
    assert "qb" not in resident.policy_bound  # w waited for room, not for its policy

    resident.finish(["p1"])
    assert resident.affected() == {"qb"}
    expected = Resident(resident.snapshot(101.0), full_every=1e9).cycle(101.0, full=True)
    decision = resident.cycle(101.0)
    assert [p.victim for p in decision.preemptions] == [p.victim for p in expected.preemptions] == ["r1"]
