"""One scheduling cycle: a pure function from a snapshot to placements, preemptions and reasons.

The contract is docs/scheduling.md. In short, for one tenant:

1. A task is eligible only if its policy stays within its limit and the tenant within its share.
2. Guaranteed tasks (their policy stays within its reservation) are all considered before any
   borrowing task.
3. Within each band, queue heads compete on: the policy's queuing priority for the profile (higher
   first), the profile's execution priority in the pool the task would go to (higher first), the task's
   own priority (higher first), fair share (the policy's usage over its reservation, lower first), then
   submit time (earlier first) and the task id, so that the same snapshot always gives the same result.
4. A task goes to the first online pool of its profile's order that supports its sharing method and has
   room for it.
5. Strict FIFO: a head that cannot go blocks its queue for the cycle. Best-effort FIFO: later tasks may
   pass it, but a head that has waited past the profile's starvation bound holds its pool: nothing
   considered after it is placed there this cycle.
6. A guaranteed task that fits nowhere may reclaim capacity from borrowed work: victims in one pool of its
   order whose policies are above their reservations and stay at or above them, lowest queuing priority
   first, then most recently started; only if that lets the task start there, never one victim twice.
   The task is placed in the freed capacity in the same cycle.

Every task left queued gets a reason a person can read.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from .model import (
    Allocation,
    Decision,
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
from .units import describe

GUARANTEED, BORROWING = 0, 1
_SHARING_NEEDS = {Sharing.WHOLE: None, Sharing.FRACTION: Sharing.FRACTION, Sharing.MIG: Sharing.MIG}


def schedule(snapshot: Snapshot) -> Decision:
    """Decide placements and preemptions for one tenant's snapshot. Deterministic; no I/O."""
    return _Cycle(snapshot).run()


def task_order(task: Task) -> tuple[int, float, str]:
    """The order of tasks within one compute resource's queue: priority, then submit time."""
    return (-task.priority, task.submitted_at, task.id)


@dataclass
class _QueueState:
    queue: Queue
    policy: Policy
    profile: Profile
    tasks: list[Task]
    done: list[bool] = field(default_factory=list)
    blocked_by: str | None = None  # strict FIFO: the head that blocks this queue for the cycle
    smallest: int = 0  # the smallest task size in the queue
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
class _Memo:
    """What the cycle found at one `version` of its usage and held pools."""

    version: int
    room: dict[tuple[str, Sharing], int] = field(default_factory=dict)  # profile, sharing: most free
    reclaimable: dict[str, int] = field(default_factory=dict)  # pool: an upper bound of what reclaim frees
    no_reclaim: set[tuple[str, str, Sharing, int]] = field(default_factory=set)  # profile, policy, task kind
    no_room: dict[tuple[str, Sharing, int], Reason] = field(default_factory=dict)  # profile, task kind


class _Cycle:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.now = snapshot.now
        self.pools: dict[str, Pool] = {pool.id: pool for pool in snapshot.pools}
        self.profiles: dict[str, Profile] = {profile.id: profile for profile in snapshot.profiles}
        self.policies: dict[str, Policy] = {policy.id: policy for policy in snapshot.policies}
        self.queue_priority: dict[str, int] = {queue.id: queue.queuing_priority for queue in snapshot.queues}
        self.queue_policy: dict[str, str] = {queue.id: queue.policy for queue in snapshot.queues}
        self.running_policy: dict[str, str] = {
            allocation.task: self.queue_policy.get(allocation.queue, "") for allocation in snapshot.running
        }

        self.pool_used: dict[str, int] = defaultdict(int)
        self.policy_used: dict[str, int] = defaultdict(int)
        self.total_used = 0
        self.in_pool: dict[str, list[Allocation]] = defaultdict(list)
        for allocation in snapshot.running:
            self.pool_used[allocation.pool] += allocation.size
            policy_id = self.queue_policy.get(allocation.queue)
            if policy_id is not None:
                self.policy_used[policy_id] += allocation.size
            self.total_used += allocation.size
            self.in_pool[allocation.pool].append(allocation)

        self.placements: dict[str, Placement] = {}
        # Placements of this cycle, which a guaranteed task may still take back from a policy that ends
        # up above its reservation (see _settle): taking one back costs nothing, unlike a preemption.
        self.placed_now: dict[str, tuple[_QueueState, int]] = {}
        self.placed_in_queue: dict[str, list[Allocation]] = defaultdict(list)  # this cycle's, by queue
        self.waiting_guaranteed: list[tuple[_QueueState, int]] = []
        self.preemptions: list[Preemption] = []
        self.preempted: set[str] = set()
        self.reasons: dict[str, Reason] = {}
        self.held: dict[str, str] = {}  # pool -> id of the starving head it is held for
        self.holding: set[str] = set()  # the tasks that pools are held for
        self.version = 0  # bumped whenever usage or the held pools change; see _memo
        self._home_cache: dict[tuple[str, Sharing, int], str | None] = {}
        self._memo_entries = _Memo(-1)
        self._message_cache: dict[tuple[object, ...], Reason] = {}

        self.states: list[_QueueState] = []
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
                _QueueState(queue, policy, profile, tasks, [False] * len(tasks), smallest=smallest)
            )

    # -- the cycle -------------------------------------------------------------------------------------

    def run(self) -> Decision:
        for band in (GUARANTEED, BORROWING):
            self._run_band(band)
        self._settle()
        self._give_reasons_to_the_rest()
        reasons = {
            task_id: reason for task_id, reason in self.reasons.items() if task_id not in self.placements
        }
        return Decision(tuple(self.placements.values()), tuple(self.preemptions), reasons)

    def _settle(self) -> None:
        """Give guaranteed tasks that found no room a second chance at reclaim, after borrowing.

        Borrowing placements can raise a policy above its reservation, which makes its work reclaimable.
        A guaranteed task must not be left waiting while such work could make room for it, so each one
        tries reclaim again, in the order it was first considered. A borrowing placement of this cycle
        that is reclaimed is simply not made; work that was already running is preempted.
        """
        for state, index in self.waiting_guaranteed:
            task, policy = state.tasks[index], state.policy
            if self._ineligible(policy, task) is not None or not self._guaranteed(policy, task):
                continue
            pool = self._place(state.profile, task) or self._reclaim(state.profile, policy, task)
            if pool is not None:
                self._commit(task, policy, pool, band=GUARANTEED)
                self.placed_now[task.id] = (state, index)
                del self.reasons[task.id]

    def _run_band(self, band: int) -> None:
        heap: list[tuple[tuple[object, ...], int, int, int]] = []
        for number, state in enumerate(self.states):
            self._push_head(heap, number, state, 0, band)
        while heap:
            key, number, index, used = heapq.heappop(heap)
            state = self.states[number]
            task = state.tasks[index]
            if self.policy_used[state.policy.id] != used:  # its key changes only with its policy's usage
                fresh = self._key(state, task)
                if fresh != key and heap and fresh > heap[0][0]:
                    # Fair share moved since this entry was pushed: re-queue it at its true position.
                    heapq.heappush(heap, (fresh, number, index, self.policy_used[state.policy.id]))
                    continue
            if band == GUARANTEED and not self._guaranteed(state.policy, task):
                # Its policy's own placements since it was pushed make it borrow now: it waits for the
                # borrowing band (and, in strict FIFO, so does everything behind it).
                if not state.profile.strict_fifo:
                    self._push_head(heap, number, state, index + 1, band)
                continue
            self._consider(state, index, band)
            self._push_head(heap, number, state, index + 1, band)

    def _push_head(
        self,
        heap: list[tuple[tuple[object, ...], int, int, int]],
        number: int,
        state: _QueueState,
        start: int,
        band: int,
    ) -> None:
        if state.blocked_by is not None:
            return
        if (
            band == GUARANTEED
            and self.policy_used[state.policy.id] + state.smallest > state.policy.reservation
        ):
            return  # nothing in this queue fits its policy's reservation any more
        index = state.pending(start)
        while index < len(state.tasks):
            task = state.tasks[index]
            if band == BORROWING or self._guaranteed(state.policy, task):
                heapq.heappush(
                    heap, (self._key(state, task), number, index, self.policy_used[state.policy.id])
                )
                return
            if state.profile.strict_fifo:
                return  # the head borrows: in strict FIFO nothing behind it goes in the guaranteed band
            index = state.pending(index + 1)

    def _key(self, state: _QueueState, task: Task) -> tuple[object, ...]:
        home = self._home(state.profile, task)
        execution = state.profile.execution_priority.get(home, 0) if home is not None else 0
        policy = state.policy
        fair_share = self.policy_used[policy.id] / max(policy.reservation, 1)
        return (
            -state.queue.queuing_priority,
            -execution,
            -task.priority,
            fair_share,
            task.submitted_at,
            task.id,
        )

    def _guaranteed(self, policy: Policy, task: Task) -> bool:
        return self.policy_used[policy.id] + task.size <= policy.reservation

    def _consider(self, state: _QueueState, index: int, band: int) -> None:
        task, policy = state.tasks[index], state.policy
        is_head = state.head() == index
        refusal = self._ineligible(policy, task)
        if refusal is not None:
            self._give_up(state, index, refusal)
            if band == BORROWING and not state.profile.strict_fifo:
                self._refuse_the_same_behind(state, index)
            return
        pool = self._place(state.profile, task)
        if pool is None and band == GUARANTEED:
            pool = self._reclaim(state.profile, policy, task)
        if pool is not None:
            self._commit(task, policy, pool, band=band)
            state.done[index] = True
            self.placed_now[task.id] = (state, index)
            return
        if band == GUARANTEED:
            self.waiting_guaranteed.append((state, index))
        if is_head and self._starving(state.profile, task):
            home = self._home(state.profile, task)
            if home is not None and home not in self.held:
                self.held[home] = task.id
                self.holding.add(task.id)
                self.version += 1  # a held pool changes what others may place and reclaim
        # Given up on for the whole cycle: free capacity only shrinks from here, so the borrowing band
        # would not find room the guaranteed band did not.
        self._give_up(state, index, self._no_room_reason(state.profile, task))

    def _refuse_the_same_behind(self, state: _QueueState, index: int) -> None:
        """In the borrowing band usage only grows, so every task after `index` in this queue that is at least
        as large fails the same limit or share check: settle them in one pass instead of one heap round
        each (a long queue behind an exhausted limit would otherwise cost a heap operation per task)."""
        size = state.tasks[index].size
        refusals: dict[int, Reason | None] = {}  # usage is fixed through this pass: one check per size
        tasks, done, reasons = state.tasks, state.done, self.reasons
        for following in range(index + 1, len(tasks)):
            if done[following]:
                continue
            task = tasks[following]
            if task.size < size:
                return
            if task.size not in refusals:
                refusals[task.size] = self._ineligible(state.policy, task)
            refusal = refusals[task.size]
            if refusal is None:
                return
            reasons[task.id] = refusal
            done[following] = True

    def _give_up(self, state: _QueueState, index: int, reason: Reason) -> None:
        task = state.tasks[index]
        self.reasons[task.id] = reason
        state.done[index] = True
        if state.profile.strict_fifo:
            state.blocked_by = task.id

    def _ineligible(self, policy: Policy, task: Task) -> Reason | None:
        used = self.policy_used[policy.id]
        if used + task.size > policy.limit:
            return self._reason(
                ("limit", policy.id, used, task.size),
                "policy_limit",
                lambda: (
                    f"Policy {policy.label} is at its limit of {describe(policy.limit)}: it uses "
                    f"{describe(used)} and this task needs {describe(task.size)}."
                ),
            )
        share = self.snapshot.tenant_share
        if share is not None and self.total_used + task.size > share:
            return self._reason(
                ("share", self.total_used, task.size),
                "tenant_share",
                lambda: (
                    f"The tenant's GPU share of {describe(share)} is exhausted: {describe(self.total_used)} "
                    f"in use and this task needs {describe(task.size)}."
                ),
            )
        return None

    # -- placement -------------------------------------------------------------------------------------

    def _fits_kind(self, pool: Pool, task: Task) -> bool:
        need = _SHARING_NEEDS[task.sharing]
        return pool.online and (need is None or need in pool.sharing) and pool.capacity >= task.size

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
        need = _SHARING_NEEDS[sharing]
        room = 0
        for pool_id in profile.pools:
            pool = self.pools.get(pool_id)
            if pool is not None and pool.online and (need is None or need in pool.sharing):
                room = max(room, pool.capacity - self.pool_used[pool_id])
        memo.room[(profile.id, sharing)] = room
        return room

    def _place(self, profile: Profile, task: Task) -> str | None:
        if task.size > self._room(profile, task.sharing):
            return None
        for pool_id in profile.pools:
            pool = self.pools.get(pool_id)
            if pool is None or not self._fits_kind(pool, task):
                continue
            if self.held.get(pool_id, task.id) != task.id:
                continue
            if pool.capacity - self.pool_used[pool_id] >= task.size:
                return pool_id
        return None

    def _commit(self, task: Task, policy: Policy, pool: str, *, band: int) -> None:
        self.placements[task.id] = Placement(task.id, pool)
        allocation = Allocation(task.id, task.queue, pool, task.size, self.now)
        self.in_pool[pool].append(allocation)
        self.placed_in_queue[task.queue].append(allocation)
        self.pool_used[pool] += task.size
        self.policy_used[policy.id] += task.size
        self.total_used += task.size
        self.version += 1
        if self.held.get(pool) == task.id:
            del self.held[pool]
            self.holding.discard(task.id)

    # -- reclaim ---------------------------------------------------------------------------------------

    def _excess(self, policy_id: str) -> int:
        policy = self.policies.get(policy_id)
        return self.policy_used[policy_id] - policy.reservation if policy is not None else 0

    def _reclaimable(self, pool_id: str) -> int:
        """An upper bound on what reclaim could free in a pool: borrowed work above its policies' floors."""
        memo = self._memo()
        cached = memo.reclaimable.get(pool_id)
        if cached is not None:
            return cached
        by_policy: dict[str, int] = defaultdict(int)
        for allocation in self.in_pool[pool_id]:
            if allocation.task not in self.preempted:
                by_policy[self.queue_policy.get(allocation.queue, "")] += allocation.size
        total = sum(min(size, max(self._excess(policy), 0)) for policy, size in by_policy.items())
        memo.reclaimable[pool_id] = total
        return total

    def _reclaim(self, profile: Profile, policy: Policy, task: Task) -> str | None:
        """Preempt borrowed work (or take back this cycle's placements) to make room for a guaranteed task;
        the pool it makes room in, or None. A refusal holds for every task of the same size and sharing
        method of the same profile and policy until usage or the held pools change, so it is remembered
        until then (a long queue would otherwise repeat it task by task); a task that holds a pool is
        asked afresh, since the pool it holds is open to it alone."""
        memo = self._memo()
        holder = task.id in self.holding
        asked = (profile.id, policy.id, task.sharing, task.size)
        if asked in memo.no_reclaim and not holder:
            return None
        for pool_id in profile.pools:
            pool = self.pools.get(pool_id)
            if pool is None or not self._fits_kind(pool, task) or self.held.get(pool_id, task.id) != task.id:
                continue
            need = task.size - (pool.capacity - self.pool_used[pool_id])
            if need <= 0 or self._reclaimable(pool_id) < need:
                continue
            victims = self._choose_victims(pool_id, policy.id, need)
            if victims is None:
                continue
            for victim in victims:
                victim_policy = self.queue_policy[victim.queue]
                self.preempted.add(victim.task)
                if victim.task in self.placed_now:
                    self._take_back(victim, pool_id, policy, task.id)
                else:
                    self.preemptions.append(Preemption(victim.task, pool_id, task.id))
                    self.pool_used[pool_id] -= victim.size
                self.policy_used[victim_policy] -= victim.size
                self.total_used -= victim.size
            self.version += 1
            return pool_id
        if not holder:
            memo.no_reclaim.add(asked)
        return None

    def _memo(self) -> _Memo:
        """Answers that hold until usage or the held pools change, that is while `version` stays."""
        if self._memo_entries.version != self.version:
            self._memo_entries = _Memo(self.version)
        return self._memo_entries

    def _take_back(self, victim: Allocation, pool_id: str, for_policy: Policy, for_task: str) -> None:
        """Take back this cycle's placement `victim` in `pool_id` (policy and total usage are adjusted by
        the caller). Where a later task of the same queue was placed this cycle elsewhere, the earlier task
        moves into that place and the later one is the one not placed, so the queue's order holds.

        Preemptions made to give a taken-back placement its room now serve whoever takes that room: the
        reclaiming task `for_task` in `pool_id`, or `victim` where it moves into a later task's place (so
        no run is stopped for a task that then does not start)."""
        self._pass_on(victim.task, pool_id, for_task)
        _, index = self.placed_now[victim.task]
        later = [
            allocation
            for allocation in self.placed_in_queue[victim.queue]
            if allocation.pool != pool_id
            and allocation.size == victim.size
            and allocation.task in self.placed_now
            and allocation.task not in self.preempted
            and self.placed_now[allocation.task][1] > index
        ]
        self.pool_used[pool_id] -= victim.size
        self.in_pool[pool_id] = [a for a in self.in_pool[pool_id] if a.task != victim.task]
        if not later:
            self._unplace(victim.task, for_policy)
            return
        moved_to = max(later, key=lambda allocation: self.placed_now[allocation.task][1])
        self.preempted.discard(victim.task)
        self.preempted.add(moved_to.task)
        moved = Allocation(victim.task, victim.queue, moved_to.pool, victim.size, self.now)
        self.in_pool[moved_to.pool] = [
            moved if a.task == moved_to.task else a for a in self.in_pool[moved_to.pool]
        ]
        self.placed_in_queue[victim.queue] = [
            moved if a.task == victim.task else a
            for a in self.placed_in_queue[victim.queue]
            if a.task != moved_to.task
        ]
        self.placements[victim.task] = Placement(victim.task, moved_to.pool)
        self._pass_on(moved_to.task, moved_to.pool, victim.task)
        self._unplace(moved_to.task, for_policy)

    def _pass_on(self, from_task: str, pool_id: str, to_task: str) -> None:
        self.preemptions = [
            Preemption(p.victim, p.pool, to_task) if p.for_task == from_task and p.pool == pool_id else p
            for p in self.preemptions
        ]

    def _unplace(self, task_id: str, for_policy: Policy) -> None:
        """Take back a placement made earlier in this cycle (usage is adjusted by the caller)."""
        del self.placements[task_id]
        state, index = self.placed_now.pop(task_id)
        self.reasons[task_id] = self._reason(
            ("reclaimed", for_policy.id),
            "reclaimed",
            lambda: (
                f"The capacity it was about to borrow went to guaranteed work of policy {for_policy.label}."
            ),
        )
        state.done[index] = True

    def _choose_victims(self, pool_id: str, for_policy: str, need: int) -> list[Allocation] | None:
        queue_policy, preempted, placed_now = self.queue_policy, self.preempted, self.placed_now
        excess: dict[str, int] = {}  # what each policy holds above its reservation
        candidates = []
        for allocation in self.in_pool[pool_id]:
            policy = queue_policy.get(allocation.queue, for_policy)
            if policy == for_policy or allocation.task in preempted:
                continue
            above = excess.get(policy)
            if above is None:
                above = excess[policy] = self._excess(policy)
            if above <= 0:
                continue
            if allocation.task in placed_now and self._stopped_own_work_for(allocation.task, for_policy):
                continue
            candidates.append(allocation)
        candidates.sort(
            key=lambda allocation: (
                self.queue_priority.get(allocation.queue, 0),
                -allocation.started_at,
                allocation.task,
            )
        )
        chosen: list[Allocation] = []
        freed = 0
        for allocation in candidates:
            policy = self.queue_policy[allocation.queue]
            if allocation.size > excess[policy]:
                continue  # preempting it would take its policy below its reservation
            chosen.append(allocation)
            excess[policy] -= allocation.size
            freed += allocation.size
            if freed >= need:
                return chosen
        return None  # no useless preemption: if the task still could not start, preempt nothing

    def _stopped_own_work_for(self, task_id: str, policy_id: str) -> bool:
        """Whether this cycle preempted work of `policy_id` to place `task_id` (a placement of this cycle):
        taking it back for `policy_id` would leave its own work stopped for its own task, so it is not a
        candidate."""
        return any(
            p.for_task == task_id and self.running_policy.get(p.victim) == policy_id for p in self.preemptions
        )

    # -- reasons ---------------------------------------------------------------------------------------

    def _starving(self, profile: Profile, task: Task) -> bool:
        bound = profile.starvation_seconds
        return not profile.strict_fifo and bound is not None and self.now - task.submitted_at > bound

    def _reason(self, key: tuple[object, ...], code: str, message: Callable[[], str]) -> Reason:
        reason = self._message_cache.get(key)
        if reason is None:
            reason = self._message_cache[key] = Reason(code, message())
        return reason

    def _no_room_reason(self, profile: Profile, task: Task) -> Reason:
        """Why a task found no room; the same for every task of its size and sharing method in the profile
        until usage or the held pools change (other than for a task that holds a pool)."""
        if task.id in self.holding:
            return self._why_no_room(profile, task)
        memo = self._memo()
        key = (profile.id, task.sharing, task.size)
        reason = memo.no_room.get(key)
        if reason is None:
            reason = memo.no_room[key] = self._why_no_room(profile, task)
        return reason

    def _why_no_room(self, profile: Profile, task: Task) -> Reason:
        home = self._home(profile, task)
        if home is None:
            return self._reason(
                ("never", profile.id, task.sharing, task.size),
                "no_pool_can_hold",
                lambda: (
                    f"No online pool of its profile can hold {describe(task.size)} "
                    f"({task.sharing.value}); the pools are offline, too small, or lack that sharing method."
                ),
            )
        holders = [
            self.held[pool_id]
            for pool_id in profile.pools
            if pool_id in self.held and self.held[pool_id] != task.id
        ]
        if holders and task.size <= self._room(profile, task.sharing):
            return self._reason(
                ("held", profile.id, holders[0]),
                "capacity_held",
                lambda: (
                    f"Capacity is held for task {holders[0]}, which has waited past its starvation bound."
                ),
            )
        return Reason(  # kept in the memo by _no_room_reason while usage stays as it is
            "no_capacity",
            f"No pool in its profile's order has {describe(task.size)} free ("
            + ", ".join(
                f"{pool.label}: {describe(pool.capacity - self.pool_used[pool.id])}"
                for pool in (self.pools[pool_id] for pool_id in profile.pools if pool_id in self.pools)
                if self._fits_kind(pool, task)
            )
            + " free).",
        )

    def _give_reasons_to_the_rest(self) -> None:
        for state in self.states:
            for index, task in enumerate(state.tasks):
                if state.done[index]:
                    continue
                if state.blocked_by is not None:
                    blocker = state.blocked_by
                    self.reasons[task.id] = self._reason(
                        ("fifo", blocker),
                        "strict_fifo",
                        partial(
                            "Waiting behind task {}, the head of this strict-FIFO queue.".format, blocker
                        ),
                    )
                elif task.id not in self.reasons:
                    self.reasons[task.id] = Reason(
                        "not_reached", "Not considered this cycle; it will be next cycle."
                    )
