"""What one scheduling cycle knows as it goes: the snapshot's pools, profiles and policies by id, usage
per pool and policy, this cycle's placements, preemptions and reasons, and the answers that hold while
usage stays as it is. The cycle (cycle.py), its preemption (preemption.py) and its reasons (reasons.py)
all work on this state."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from .model import (
    Allocation,
    Placement,
    Policy,
    Pool,
    Preemption,
    Profile,
    Queue,
    Reason,
    Sharing,
    Snapshot,
    Task,
)

GUARANTEED, BORROWING = 0, 1
SHARING_NEEDS = {Sharing.WHOLE: None, Sharing.FRACTION: Sharing.FRACTION, Sharing.MIG: Sharing.MIG}


def task_order(task: Task) -> tuple[int, float, str]:
    """The order of tasks within one compute resource's queue: priority, then submit time."""
    return (-task.priority, task.submitted_at, task.id)


@dataclass
class QueueState:
    queue: Queue
    policy: Policy
    profile: Profile
    tasks: list[Task]
    done: list[bool] = field(default_factory=list)
    blocked_by: str | None = None  # strict FIFO: the head that blocks this queue for the cycle
    smallest: int = 0  # the smallest task size in the queue
    planned: bool = False  # its blocked head was planned a start this cycle (or could not be)
    _head: int = 0

    def head(self) -> int:
        """The index of the queue's first task still waiting (tasks only ever leave, so it only moves on)."""
        self._head = self.pending(self._head)
        return self._head

    def pending(self, start: int) -> int:
        """The index of the first task at or after `start` that is not placed or given up on."""
        index = start
        while index < len(self.tasks) and self.done[index]:
            index += 1
        return index


@dataclass
class Reservation:
    """A blocked head's planned start in one pool (EASY backfill): at `start` the pool will have room for
    it, because the work running there reaches its time limits; `extra` is what will still be free beside
    it then. Another task may go into the pool now only if it ends by `start` or fits in `extra`."""

    task: str
    size: int
    start: float
    extra: int
    band: int  # the head's band when it was planned
    policy: str  # the head's policy

    def admits(self, task: Task, now: float) -> bool:
        ends_in_time = task.time_limit is not None and now + task.time_limit <= self.start
        return ends_in_time or task.size <= self.extra


@dataclass(frozen=True)
class Plans:
    """The holds and planned starts a cycle ends with: pool -> the starving head it is held for, pool and
    policy -> the blocked head planned to start there."""

    held: dict[str, str]
    reserved: dict[str, Reservation]
    policy_reserved: dict[str, Reservation]


@dataclass
class Usage:
    """What running work holds: per pool, per policy and in all, the allocations in each pool (by task, so
    that one leaves in constant time however many share its pool), the pools
    each policy has work in (a superset once work leaves: planning a head reads its policy's work in those
    pools, not every pool), and each running task's policy."""

    pool_used: defaultdict[str, int]
    policy_used: defaultdict[str, int]
    total_used: int
    in_pool: defaultdict[str, dict[str, Allocation]]
    policy_pools: defaultdict[str, set[str]]
    running_policy: dict[str, str]

    @classmethod
    def of(cls, running: Iterable[Allocation], queue_policy: Mapping[str, str]) -> Usage:
        usage = cls(defaultdict(int), defaultdict(int), 0, defaultdict(dict), defaultdict(set), {})
        for allocation in running:
            usage.add(allocation, queue_policy.get(allocation.queue))
        return usage

    def add(self, allocation: Allocation, policy_id: str | None) -> None:
        self.pool_used[allocation.pool] += allocation.size
        if policy_id is not None:
            self.policy_used[policy_id] += allocation.size
            self.policy_pools[policy_id].add(allocation.pool)
        self.total_used += allocation.size
        self.in_pool[allocation.pool][allocation.task] = allocation
        self.running_policy[allocation.task] = policy_id or ""

    def remove(self, allocation: Allocation, policy_id: str | None) -> None:
        self.pool_used[allocation.pool] -= allocation.size
        if policy_id is not None:
            self.policy_used[policy_id] -= allocation.size
        self.total_used -= allocation.size
        self.in_pool[allocation.pool].pop(allocation.task, None)
        del self.running_policy[allocation.task]

    def copy(self) -> Usage:
        """A copy a cycle may change (the running tasks' policies are only read, and shared)."""
        return Usage(
            defaultdict(int, self.pool_used),
            defaultdict(int, self.policy_used),
            self.total_used,
            defaultdict(dict, {pool: dict(items) for pool, items in self.in_pool.items()}),
            defaultdict(set, {policy: set(pools) for policy, pools in self.policy_pools.items()}),
            self.running_policy,
        )


@dataclass
class Memo:
    """What the cycle found at one `version` of its usage and held pools."""

    version: int
    room: dict[tuple[str, Sharing], int] = field(default_factory=dict)  # profile, sharing: most free
    reclaimable: dict[str, int] = field(default_factory=dict)  # pool: an upper bound of what reclaim frees
    no_reclaim: set[tuple[str, str, Sharing, int]] = field(default_factory=set)  # profile, policy, task kind
    no_room: dict[tuple[str, Sharing, int], Reason] = field(default_factory=dict)  # profile, task kind
    # Refusals for room that changed nothing else, by queue, band and task kind (sharing, size, time limit)
    refused: dict[tuple[object, ...], Reason] = field(default_factory=dict)
    # Tasks settling found no room for, by policy, profile and task kind (_Cycle._settle)
    unsettled: set[tuple[object, ...]] = field(default_factory=set)


class CycleState:
    """The state of one cycle, and the questions every part of it asks (where a task could go, how much
    room a profile has, the reason given for a situation)."""

    def __init__(self, snapshot: Snapshot, usage: Usage | None = None, carried: Plans | None = None) -> None:
        """`usage`: what `snapshot.running` holds, when the caller keeps it already (copied here, never
        changed). `carried`: holds and planned starts of heads not in this snapshot's queued tasks, kept
        from an earlier cycle (an incremental cycle, resident.py)."""
        self.snapshot = snapshot
        self.now = snapshot.now
        self.pools: dict[str, Pool] = {pool.id: pool for pool in snapshot.pools}
        self.profiles: dict[str, Profile] = {profile.id: profile for profile in snapshot.profiles}
        self.policies: dict[str, Policy] = {policy.id: policy for policy in snapshot.policies}
        self.queue_priority: dict[str, int] = {queue.id: queue.queuing_priority for queue in snapshot.queues}
        self.queue_policy: dict[str, str] = {queue.id: queue.policy for queue in snapshot.queues}
        usage = usage.copy() if usage is not None else Usage.of(snapshot.running, self.queue_policy)
        self.running_policy = usage.running_policy
        self.pool_used = usage.pool_used
        self.policy_used = usage.policy_used
        self.total_used = usage.total_used
        self.in_pool = usage.in_pool
        self.policy_pools = usage.policy_pools

        self.placements: dict[str, Placement] = {}
        # Placements of this cycle, which a guaranteed task may still take back from a policy that ends
        # up above its reservation (see _settle): taking one back costs nothing, unlike a preemption.
        self.placed_now: dict[str, tuple[QueueState, int]] = {}
        self.placed_in_queue: dict[str, list[Allocation]] = defaultdict(list)  # this cycle's, by queue
        self.waiting_guaranteed: list[tuple[QueueState, int]] = []
        self.preemptions: list[Preemption] = []
        self.preempted: set[str] = set()
        self.reasons: dict[str, Reason] = {}
        carried = carried or Plans({}, {}, {})
        self.held: dict[str, str] = dict(carried.held)  # pool -> id of the starving head it is held for
        self.holding: set[str] = set(self.held.values())  # the tasks that pools are held for
        # pool -> the blocked head planned to start there; policy -> the blocked head its room is kept for
        self.reserved: dict[str, Reservation] = {key: replace(r) for key, r in carried.reserved.items()}
        self.policy_reserved: dict[str, Reservation] = {
            key: replace(r) for key, r in carried.policy_reserved.items()
        }
        self.planned_heads: set[str] = {r.task for r in self.reserved.values()} | {
            r.task for r in self.policy_reserved.values()
        }  # the tasks reservations are held for
        self.version = 0  # bumped whenever usage or the held pools change; see _memo
        self._home_cache: dict[tuple[str, Sharing, int], str | None] = {}
        self._memo_entries = Memo(-1)
        self._message_cache: dict[tuple[object, ...], Reason] = {}

        self.states: list[QueueState] = []
        by_queue: dict[str, list[Task]] = defaultdict(list)
        for task in snapshot.queued:
            by_queue[task.queue].append(task)
        known = {queue.id for queue in snapshot.queues}
        for queue_id, tasks in by_queue.items():
            if queue_id not in known:
                for task in tasks:
                    self.reasons[task.id] = Reason(
                        "no_compute_resource", "Its compute resource no longer exists; submit it to another."
                    )
        for queue in sorted(snapshot.queues, key=lambda queue: queue.id):
            tasks = sorted(by_queue.get(queue.id, ()), key=task_order)
            policy, profile = self.policies.get(queue.policy), self.profiles.get(queue.profile)
            if not tasks:
                continue
            if policy is None or profile is None:
                for task in tasks:
                    self.reasons[task.id] = Reason(
                        "no_compute_resource",
                        "Its compute resource lost its policy or profile; ask an admin.",
                    )
                continue
            smallest = min(task.size for task in tasks)
            self.states.append(
                QueueState(queue, policy, profile, tasks, [False] * len(tasks), smallest=smallest)
            )

    def _fits_kind(self, pool: Pool, task: Task) -> bool:
        need = SHARING_NEEDS[task.sharing]
        return pool.online and (need is None or need in pool.sharing) and pool.capacity >= task.size

    def _guaranteed(self, policy: Policy, task: Task) -> bool:
        return self.policy_used[policy.id] + task.size <= policy.reservation

    def _binds(self, pool_id: str, task: Task, policy: Policy) -> bool:
        """Whether a pool's reservation for another task limits where `task` may go: always, but a
        borrowing head's does not keep out another policy's guaranteed work (guaranteed comes first)."""
        reservation = self.reserved.get(pool_id)
        if reservation is None or reservation.task == task.id:
            return False
        return not (
            reservation.band == BORROWING
            and reservation.policy != policy.id
            and self._guaranteed(policy, task)
        )

    def _home(self, profile: Profile, task: Task) -> str | None:
        """The first pool of the profile's order that could ever hold the task."""
        key = (profile.id, task.sharing, task.size)
        if key not in self._home_cache:
            self._home_cache[key] = next(
                (
                    pool_id
                    for pool_id in profile.pools
                    if (pool := self.pools.get(pool_id)) and self._fits_kind(pool, task)
                ),
                None,
            )
        return self._home_cache[key]

    def _room(self, profile: Profile, sharing: Sharing) -> int:
        """The most free capacity in any pool the profile may use for this sharing method."""
        memo = self._memo()
        cached = memo.room.get((profile.id, sharing))
        if cached is not None:
            return cached
        need = SHARING_NEEDS[sharing]
        room = 0
        for pool_id in profile.pools:
            pool = self.pools.get(pool_id)
            if pool is not None and pool.online and (need is None or need in pool.sharing):
                room = max(room, pool.capacity - self.pool_used[pool_id])
        memo.room[(profile.id, sharing)] = room
        return room

    def _memo(self) -> Memo:
        """Answers that hold until usage or the held pools change, that is while `version` stays."""
        if self._memo_entries.version != self.version:
            self._memo_entries = Memo(self.version)
        return self._memo_entries

    def _reason(self, key: tuple[object, ...], code: str, message: Callable[[], str]) -> Reason:
        reason = self._message_cache.get(key)
        if reason is None:
            reason = self._message_cache[key] = Reason(code, message())
        return reason
