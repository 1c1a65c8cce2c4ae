"""The contract's invariants, checked after a cycle on random snapshots (hypothesis)."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.scheduling.engine import (
    Allocation,
    Decision,
    Policy,
    Pool,
    Profile,
    Queue,
    Sharing,
    Snapshot,
    Task,
    schedule,
    units,
)

MIXED_SIZES = [
    (units(Fraction(1, 7)), Sharing.MIG),
    (units("0.25"), Sharing.FRACTION),
    (units("0.5"), Sharing.FRACTION),
    (units(1), Sharing.WHOLE),
    (units(2), Sharing.WHOLE),
    (units(4), Sharing.WHOLE),
    (units(8), Sharing.WHOLE),
]


@st.composite
def snapshots(draw: st.DrawFn, *, uniform: bool) -> Snapshot:
    pool_count = draw(st.integers(1, 4))
    pools = tuple(
        Pool(
            f"pool{i}",
            units(draw(st.integers(1, 8))),
            draw(st.booleans()) or i == 0,
            frozenset({Sharing.WHOLE}) | draw(st.sets(st.sampled_from([Sharing.FRACTION, Sharing.MIG]))),
        )
        for i in range(pool_count)
    )
    pool_ids = [pool.id for pool in pools]
    profiles = tuple(
        Profile(
            f"profile{i}",
            tuple(draw(st.permutations(pool_ids))[: draw(st.integers(1, pool_count))]),
            {pool_id: draw(st.integers(0, 2)) for pool_id in pool_ids},
            draw(st.booleans()),
            None if uniform else draw(st.none() | st.floats(0, 2000)),
        )
        for i in range(draw(st.integers(1, 3)))
    )
    policies = []
    for i in range(draw(st.integers(1, 4))):
        reservation = draw(st.integers(0, 8))
        policies.append(
            Policy(f"policy{i}", units(reservation), units(reservation + draw(st.integers(0, 8))))
        )
    queues = tuple(
        Queue(
            f"queue{i}",
            draw(st.sampled_from(policies)).id,
            draw(st.sampled_from(profiles)).id,
            draw(st.integers(0, 3)),
        )
        for i in range(draw(st.integers(1, 5)))
    )
    share = draw(st.none() | st.integers(1, 24).map(units))
    unit_size = draw(st.sampled_from([units(1), units(2)]))

    def size_and_sharing() -> tuple[int, Sharing]:
        return (unit_size, Sharing.WHOLE) if uniform else draw(st.sampled_from(MIXED_SIZES))

    # Running work that respects every capacity, limit and the share, as a real tenant's would.
    limit = {policy.id: policy.limit for policy in policies}
    queue_policy = {queue.id: queue.policy for queue in queues}
    pool_used: dict[str, int] = defaultdict(int)
    policy_used: dict[str, int] = defaultdict(int)
    running = []
    for i in range(draw(st.integers(0, 12))):
        queue = draw(st.sampled_from(queues))
        pool = draw(st.sampled_from(pools))
        size, _ = size_and_sharing()
        fits = (
            pool_used[pool.id] + size <= pool.capacity
            and policy_used[queue.policy] + size <= limit[queue.policy]
        )
        if fits and (share is None or sum(pool_used.values()) + size <= share):
            pool_used[pool.id] += size
            policy_used[queue_policy[queue.id]] += size
            running.append(Allocation(f"run{i}", queue.id, pool.id, size, draw(st.floats(0, 1000))))
    queued = []
    for i in range(draw(st.integers(0, 20))):
        size, sharing = size_and_sharing()
        queued.append(
            Task(
                f"task{i}",
                draw(st.sampled_from(queues)).id,
                size,
                draw(st.floats(0, 1000)),
                sharing,
                draw(st.integers(0, 2)),
            )
        )
    return Snapshot(1000.0, pools, profiles, tuple(policies), queues, tuple(queued), tuple(running), share)


def after(snapshot: Snapshot, decision: Decision) -> tuple[dict[str, int], dict[str, int], list[Allocation]]:
    """Pool and policy usage, and the allocations, once the decision's preemptions and placements apply."""
    victims = {preemption.victim for preemption in decision.preemptions}
    queue_policy = {queue.id: queue.policy for queue in snapshot.queues}
    tasks = {task.id: task for task in snapshot.queued}
    allocations = [allocation for allocation in snapshot.running if allocation.task not in victims]
    allocations += [
        Allocation(p.task, tasks[p.task].queue, p.pool, tasks[p.task].size, snapshot.now)
        for p in decision.placements
    ]
    pool_used: dict[str, int] = defaultdict(int)
    policy_used: dict[str, int] = defaultdict(int)
    for allocation in allocations:
        pool_used[allocation.pool] += allocation.size
        policy_used[queue_policy[allocation.queue]] += allocation.size
    return pool_used, policy_used, allocations


def check_invariants(snapshot: Snapshot, decision: Decision) -> None:
    pools = {pool.id: pool for pool in snapshot.pools}
    policies = {policy.id: policy for policy in snapshot.policies}
    queues = {queue.id: queue for queue in snapshot.queues}
    profiles = {profile.id: profile for profile in snapshot.profiles}
    tasks = {task.id: task for task in snapshot.queued}
    pool_used, policy_used, _ = after(snapshot, decision)

    placed = [placement.task for placement in decision.placements]
    assert len(placed) == len(set(placed)), "a task was placed twice"
    victims = [preemption.victim for preemption in decision.preemptions]
    assert len(victims) == len(set(victims)), "a victim was preempted twice"
    assert set(victims) <= {allocation.task for allocation in snapshot.running}
    for pool_id, used in pool_used.items():
        assert used <= pools[pool_id].capacity, f"{pool_id} over capacity"
    for policy_id, used in policy_used.items():
        assert used <= policies[policy_id].limit, f"{policy_id} over its limit"
    if snapshot.tenant_share is not None:
        assert sum(pool_used.values()) <= snapshot.tenant_share, "tenant over its share"
    assert set(tasks) == set(placed) | set(decision.reasons), "a queued task has neither a place nor a reason"
    assert not set(placed) & set(decision.reasons)
    assert all(reason.code != "not_reached" and reason.message for reason in decision.reasons.values())
    for placement in decision.placements:
        task, pool = tasks[placement.task], pools[placement.pool]
        assert pool.online
        assert placement.pool in profiles[queues[task.queue].profile].pools
        assert task.sharing == Sharing.WHOLE or task.sharing in pool.sharing
    for preemption in decision.preemptions:
        victim_policy = queues[next(a.queue for a in snapshot.running if a.task == preemption.victim)].policy
        assert policy_used[victim_policy] >= policies[victim_policy].reservation, (
            "reclaim went below a reservation"
        )
        assert victim_policy != queues[tasks[preemption.for_task].queue].policy
        assert preemption.for_task in placed


def check_reclaim_is_complete(snapshot: Snapshot, decision: Decision) -> None:
    """With one task size, no waiting guaranteed task could start anywhere in its profile by reclaiming."""
    pools = {pool.id: pool for pool in snapshot.pools}
    policies = {policy.id: policy for policy in snapshot.policies}
    queues = {queue.id: queue for queue in snapshot.queues}
    profiles = {profile.id: profile for profile in snapshot.profiles}
    pool_used, policy_used, allocations = after(snapshot, decision)
    total = sum(pool_used.values())
    for task in snapshot.queued:
        if task.id not in decision.reasons or decision.reasons[task.id].code == "strict_fifo":
            continue
        policy = queues[task.queue].policy
        guaranteed = policy_used[policy] + task.size <= policies[policy].reservation
        within_share = snapshot.tenant_share is None or total + task.size <= snapshot.tenant_share
        if not (guaranteed and within_share):
            continue
        for pool_id in profiles[queues[task.queue].profile].pools:
            pool = pools[pool_id]
            if not pool.online or pool.capacity < task.size:
                continue
            reclaimable = 0
            for other, policy_object in policies.items():
                if other == policy:
                    continue
                in_pool = [a for a in allocations if a.pool == pool_id and queues[a.queue].policy == other]
                excess = policy_used[other] - policy_object.reservation
                reclaimable += min(len(in_pool), max(excess, 0) // task.size) * task.size
            free = pool.capacity - pool_used[pool_id]
            assert free + reclaimable < task.size, f"{task.id} waits though {pool_id} could be reclaimed"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(uniform=False))
def test_invariants_hold_on_mixed_sizes(snapshot: Snapshot) -> None:
    decision = schedule(snapshot)
    check_invariants(snapshot, decision)
    shuffled = list(snapshot.queued)
    random.Random(1).shuffle(shuffled)
    assert schedule(replace(snapshot, queued=tuple(shuffled), running=snapshot.running[::-1])) == decision


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(uniform=True))
def test_reclaim_leaves_no_guaranteed_task_waiting_behind_borrowed_work(snapshot: Snapshot) -> None:
    decision = schedule(snapshot)
    check_invariants(snapshot, decision)
    check_reclaim_is_complete(snapshot, decision)


def no_longer(earlier: Task, later: Task) -> bool:
    """Whether `earlier` asks for no more time than `later`: whatever a planned start lets `later` use now,
    it lets `earlier` use too."""
    if later.time_limit is None:
        return True
    return earlier.time_limit is not None and earlier.time_limit <= later.time_limit


def check_queue_order(snapshot: Snapshot, decision: Decision) -> None:
    """No task of a queue is placed while an earlier one of the same queue waits that is of the same sharing
    method, no larger and asks for no more time: whatever room the later one took would have held the
    earlier one."""
    placed = {placement.task for placement in decision.placements}
    by_queue: dict[str, list[Task]] = defaultdict(list)
    for task in snapshot.queued:
        by_queue[task.queue].append(task)
    for tasks in by_queue.values():
        tasks.sort(key=lambda task: (-task.priority, task.submitted_at, task.id))
        for position, earlier in enumerate(tasks):
            if earlier.id in placed:
                continue
            for later in tasks[position + 1 :]:
                passed = (
                    later.id in placed
                    and later.sharing == earlier.sharing
                    and earlier.size <= later.size
                    and no_longer(earlier, later)
                )
                assert not passed, f"{later.id} was placed while {earlier.id}, before it in its queue, waits"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(uniform=False))
def test_a_queue_order_holds(snapshot: Snapshot) -> None:
    check_queue_order(snapshot, schedule(snapshot))
