"""Backfill with time limits (EASY): a blocked head is planned a start from the running work's time limits
and its pool reserved; later work goes there only if it ends by then or fits beside the head. Rules on
small snapshots with a known answer, then a property on random snapshots: nothing placed in a cycle keeps
a planned head from starting when planned."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.scheduling.engine import Allocation, Decision, Snapshot, Task, schedule
from tests.scheduling.builders import policy, pool, profile, queue, running, snapshot, task
from tests.scheduling.test_engine_invariants import check_invariants, check_queue_order
from tests.scheduling.test_engine_invariants import snapshots as random_snapshots

NOW = 1000.0
HOUR = 3600.0


def one_pool(*queued: Task, allocations: tuple[Allocation, ...] = (), strict: bool = False) -> Snapshot:
    """Pool p of 8 GPUs; team t (reservation 0, limit 16) with queue q on it, and queue r of the same team."""
    return snapshot(
        pools=[pool("p", 8)],
        profiles=[profile("prof", ["p"], strict=strict)],
        policies=[policy("t", 0, 16)],
        queues=[queue("q", "t", "prof"), queue("r", "t", "prof")],
        queued=queued,
        allocations=allocations,
        now=NOW,
    )


BIG_RUNNING = (running("a", "q", "p", 6, started=0.0, ends=NOW + HOUR),)  # 2 GPUs free for an hour


def placed(decision: Decision) -> set[str]:
    return {placement.task for placement in decision.placements}


def test_work_that_ends_before_the_head_s_planned_start_fills_the_gap() -> None:
    decision = schedule(
        one_pool(
            task("head", "q", 8, at=1.0),
            task("long", "q", 1, at=2.0, limit=2 * HOUR),
            task("unlimited", "r", 1, at=3.0),
            task("short", "q", 1, at=4.0, limit=HOUR / 2),
            task("exact", "r", 1, at=5.0, limit=HOUR),  # ends at the very moment the head starts
            task("late", "r", 1, at=6.0, limit=60.0),  # would end in time, but the gap is full
            allocations=BIG_RUNNING,
        )
    )
    assert placed(decision) == {"short", "exact"}
    assert decision.planned == {"head": ("p", NOW + HOUR)}
    assert "reserved for it: planned to start at 1970-01-01 01:16 UTC" in decision.reasons["head"].message
    for waiting in ("long", "unlimited"):
        assert decision.reasons[waiting].code == "reserved_for_head"
        assert (
            "reserved for task head, planned to start at 1970-01-01 01:16 UTC"
            in decision.reasons[waiting].message
        )
    assert decision.reasons["late"].code == "no_capacity"


def test_a_task_that_ends_exactly_at_the_planned_start_goes() -> None:
    decision = schedule(
        one_pool(
            task("head", "q", 8, at=1.0), task("exact", "r", 2, at=3.0, limit=HOUR), allocations=BIG_RUNNING
        )
    )
    assert placed(decision) == {"exact"}


def test_work_without_a_limit_goes_only_in_what_stays_free_beside_the_head() -> None:
    allocations = (running("a", "q", "p", 4, ends=NOW + HOUR),)  # 4 free now; at +1 h, 8 free: 2 beside a 6
    decision = schedule(
        one_pool(
            task("head", "q", 6, at=1.0),
            task("beside", "q", 2, at=2.0),
            task("too-many", "r", 2, at=3.0),
            allocations=allocations,
        )
    )
    assert placed(decision) == {"beside"}
    assert decision.reasons["too-many"].code == "reserved_for_head"


def test_a_head_that_cannot_be_planned_keeps_best_effort_as_before() -> None:
    allocations = (running("a", "q", "p", 6),)  # no time limit: its end cannot be planned
    decision = schedule(
        one_pool(task("head", "q", 8, at=1.0), task("small", "q", 2, at=2.0), allocations=allocations)
    )
    assert placed(decision) == {"small"}
    assert decision.planned == {}


def test_the_earliest_start_among_the_profile_s_pools_is_planned() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("first", 8), pool("second", 8)],
            profiles=[profile("prof", ["first", "second"])],
            policies=[policy("t", 0, 32)],
            queues=[queue("q", "t", "prof")],
            queued=[task("head", "q", 8, at=1.0), task("filler", "q", 2, at=2.0)],
            allocations=[
                running("a", "q", "first", 8, ends=NOW + 3 * HOUR),
                running("b", "q", "second", 6, ends=NOW + HOUR),
            ],
            now=NOW,
        )
    )
    assert decision.planned == {"head": ("second", NOW + HOUR)}
    assert placed(decision) == set()  # "second" is reserved; "first" is full


def test_a_strict_fifo_head_is_protected_from_other_queues_too() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("p", 8)],
            profiles=[profile("strict", ["p"], strict=True), profile("loose", ["p"])],
            policies=[policy("t", 0, 16)],
            queues=[queue("q", "t", "strict"), queue("r", "t", "loose")],
            queued=[
                task("head", "q", 8, at=1.0),
                task("behind", "q", 1, at=2.0, limit=60.0),  # strict FIFO: nothing passes its own head
                task("other", "r", 2, at=3.0),  # another queue: no limit, it would delay the head
                task("quick", "r", 2, at=4.0, limit=600.0),
            ],
            allocations=BIG_RUNNING,
            now=NOW,
        )
    )
    assert placed(decision) == {"quick"}
    assert decision.reasons["other"].code == "reserved_for_head"
    assert decision.reasons["behind"].code == "strict_fifo"


def test_a_past_due_limit_plans_the_head_now_and_admits_nothing_that_would_stay() -> None:
    allocations = (running("a", "q", "p", 6, ends=NOW - 10.0),)  # past its limit: being stopped
    decision = schedule(
        one_pool(task("head", "q", 8, at=1.0), task("small", "r", 2, at=2.0), allocations=allocations)
    )
    assert decision.planned == {"head": ("p", NOW)}
    assert placed(decision) == set()


def test_a_head_held_back_by_its_policy_s_limit_is_planned_and_its_policy_s_work_waits_behind_it() -> None:
    """Team t may use 8 GPUs (all reserved, pool of 16): 6 run for an hour, an 8-GPU head waits. As a
    borrower it is passed over by the guaranteed band, but it is planned first, so its team's small
    work goes only if it ends in time."""
    decision = schedule(
        snapshot(
            pools=[pool("p", 16)],
            profiles=[profile("prof", ["p"])],
            policies=[policy("t", 8, 8)],
            queues=[queue("q", "t", "prof")],
            queued=[
                task("head", "q", 8, at=1.0),
                task("delays", "q", 1, at=2.0, limit=2 * HOUR),
                task("unlimited", "q", 1, at=3.0),
                task("in-time", "q", 1, at=4.0, limit=HOUR / 2),
            ],
            allocations=[running("a", "q", "p", 6, ends=NOW + HOUR)],
            now=NOW,
        )
    )
    assert placed(decision) == {"in-time"}
    assert decision.planned == {"head": ("p", NOW + HOUR)}
    assert decision.reasons["head"].code == "policy_limit"
    assert "planned to start at" in decision.reasons["head"].message
    for waiting in ("delays", "unlimited"):
        assert decision.reasons[waiting].code == "reserved_for_head"
        assert "Policy t's room is reserved for task head" in decision.reasons[waiting].message


def test_a_guaranteed_task_is_not_kept_out_by_a_borrowing_head_s_reservation() -> None:
    decision = schedule(
        snapshot(
            pools=[pool("p", 8)],
            profiles=[profile("prof", ["p"])],
            policies=[policy("owner", 4, 8), policy("borrower", 0, 8)],
            queues=[queue("mine", "owner", "prof"), queue("theirs", "borrower", "prof")],
            queued=[task("borrowing-head", "theirs", 8, at=1.0), task("guaranteed", "mine", 2, at=5.0)],
            allocations=[running("a", "theirs", "p", 6, ends=NOW + HOUR)],
            now=NOW,
        )
    )
    assert "guaranteed" in placed(decision)


def test_the_head_starts_when_its_planned_time_comes() -> None:
    later = one_pool(
        task("head", "q", 8, at=1.0),
        task("unlimited", "r", 1, at=5.0),
        allocations=(),  # the big run reached its limit, the short one ended before it
    )
    decision = schedule(later)
    assert placed(decision) == {"head"}


# -- the property ---------------------------------------------------------------------------------------


@st.composite
def with_limits(draw: st.DrawFn) -> Snapshot:
    """Random snapshots (as the invariant tests draw them) where most work has a time limit."""
    base = draw(random_snapshots(uniform=False))
    running_work = tuple(
        Allocation(
            item.task,
            item.queue,
            item.pool,
            item.size,
            item.started_at,
            draw(st.none() | st.floats(base.now - 100, base.now + 10 * HOUR)),
        )
        for item in base.running
    )
    queued = tuple(
        Task(
            item.id,
            item.queue,
            item.size,
            item.submitted_at,
            item.sharing,
            item.priority,
            draw(st.none() | st.floats(60, 10 * HOUR)),
        )
        for item in base.queued
    )
    return Snapshot(
        base.now,
        base.pools,
        base.profiles,
        base.policies,
        base.queues,
        queued,
        running_work,
        base.tenant_share,
    )


def free_at(snapshot: Snapshot, decision: Decision, pool_id: str, at: float) -> int:
    """What the pool has free at `at`, given the decision: the work running (less what it preempts) and
    what it placed, each there until its time limit (for ever without one)."""
    victims = {preemption.victim for preemption in decision.preemptions}
    tasks = {item.id: item for item in snapshot.queued}
    capacity = next(item.capacity for item in snapshot.pools if item.id == pool_id)
    present = [
        item.size
        for item in snapshot.running
        if item.pool == pool_id
        and item.task not in victims
        and (item.ends_at is None or max(item.ends_at, snapshot.now) > at)
    ]
    for placement in decision.placements:
        placed_task = tasks[placement.task]
        limit = placed_task.time_limit
        if placement.pool == pool_id and (limit is None or snapshot.now + limit > at):
            present.append(placed_task.size)
    return capacity - sum(present)


def policy_free_at(snapshot: Snapshot, decision: Decision, policy_id: str, at: float) -> int:
    """How far under its limit the policy is at `at`, given the decision (as free_at, per policy)."""
    victims = {preemption.victim for preemption in decision.preemptions}
    tasks = {item.id: item for item in snapshot.queued}
    policy_of = {queue.id: queue.policy for queue in snapshot.queues}
    limit = next(item.limit for item in snapshot.policies if item.id == policy_id)
    present = [
        item.size
        for item in snapshot.running
        if policy_of.get(item.queue) == policy_id
        and item.task not in victims
        and (item.ends_at is None or max(item.ends_at, snapshot.now) > at)
    ]
    for placement in decision.placements:
        placed_task = tasks[placement.task]
        limit_seconds = placed_task.time_limit
        if policy_of[placed_task.queue] == policy_id and (
            limit_seconds is None or snapshot.now + limit_seconds > at
        ):
            present.append(placed_task.size)
    return limit - sum(present)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(with_limits())
def test_nothing_placed_keeps_a_planned_head_from_starting_when_planned(snapshot: Snapshot) -> None:
    decision = schedule(snapshot)
    check_invariants(snapshot, decision)
    tasks = {item.id: item for item in snapshot.queued}
    policy_of = {queue.id: queue.policy for queue in snapshot.queues}
    pools_planned: defaultdict[str, int] = defaultdict(int)
    policies_planned: defaultdict[str, int] = defaultdict(int)
    for head, (pool_id, start) in decision.planned.items():
        assert head not in placed(decision)
        assert start >= snapshot.now
        policy_id = policy_of[tasks[head].queue]
        pools_planned[pool_id] += 1
        policies_planned[policy_id] += 1
        assert free_at(snapshot, decision, pool_id, start) >= tasks[head].size, (head, pool_id, start)
        assert policy_free_at(snapshot, decision, policy_id, start) >= tasks[head].size, (head, policy_id)
    assert all(count == 1 for count in pools_planned.values())  # one planned head per pool
    assert all(count == 1 for count in policies_planned.values())  # and per policy


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(with_limits())
def test_a_queue_order_holds_with_time_limits(snapshot: Snapshot) -> None:
    """Backfill lets a later task of a queue pass an earlier one only where the later one asks for less
    time (or is smaller, or shares its GPU another way)."""
    check_queue_order(snapshot, schedule(snapshot))
