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
5b. Backfill (EASY). A head that cannot go, in either discipline, is planned a start in the first pool of
   its order where the work running there will make room for it by their time limits (the earliest such
   time, in pool order on a tie), and that pool is reserved for it: a task considered after it goes there
   only if its own time limit ends it by that start, or it fits in what will still be free beside the head
   then. So small work fills the gap without ever delaying the head's planned start. A head that cannot
   be planned (work without a time limit stands in its way) is handled as in rule 5. Reservations of the
   borrowing band do not bind a guaranteed task's second chance (rule 6).
6. A guaranteed task that fits nowhere may reclaim capacity from borrowed work: victims in one pool of its
   order whose policies are above their reservations and stay at or above them, lowest queuing priority
   first, then most recently started; only if that lets the task start there, never one victim twice.
   The task is placed in the freed capacity in the same cycle.

Every task left queued gets a reason a person can read.
"""

from __future__ import annotations

import heapq
from collections import deque

from .backfill import Backfilling
from .model import (
    Allocation,
    Decision,
    Placement,
    Policy,
    Profile,
    Reason,
    Snapshot,
    Task,
)
from .preemption import Preempting
from .reasons import Explaining
from .state import BORROWING, GUARANTEED, Memo, QueueState
from .units import describe


def schedule(snapshot: Snapshot) -> Decision:
    """Decide placements and preemptions for one tenant's snapshot. Deterministic; no I/O."""
    return _Cycle(snapshot).run()


class _Cycle(Backfilling, Preempting, Explaining):
    """One cycle's main loop: the guaranteed band, the borrowing band, then a second chance at reclaim."""

    # Whether a task alike to one just refused for room, with nothing changed since, is refused as that one
    # was without asking again (_refused_as_before, _settle). Off only in tests that compare the two.
    remember_refusals = True

    # -- the cycle -------------------------------------------------------------------------------------

    def run(self) -> Decision:
        for band in (GUARANTEED, BORROWING):
            self._run_band(band)
        self._settle()
        self._give_reasons_to_the_rest()
        reasons = self.reasons
        if not reasons.keys().isdisjoint(self.placements):  # (looks up each placement, not each reason)
            reasons = {
                task_id: reason for task_id, reason in reasons.items() if task_id not in self.placements
            }
        planned = {
            reservation.task: (pool_id, reservation.start) for pool_id, reservation in self.reserved.items()
        }
        return Decision(tuple(self.placements.values()), tuple(self.preemptions), reasons, planned)

    def _settle(self) -> None:
        """Give guaranteed tasks that found no room a second chance at reclaim, after borrowing.

        Borrowing placements can raise a policy above its reservation, which makes its work reclaimable.
        A guaranteed task must not be left waiting while such work could make room for it, so each one
        tries reclaim again, in the order it was first considered. A borrowing placement of this cycle
        that is reclaimed is simply not made; work that was already running is preempted.

        A queue's order holds here too: where the cycle has changed (a placement, a preemption, a hold let
        go) since an earlier task of the same queue found no room in settling, that task tries again before
        a later one of its queue is asked, so room that appeared in between goes to the earlier one.

        A task goes no further than the last one of its queue's policy and profile of its kind, while nothing
        has changed since that one found no room (the memo of the cycle's version, as in _refused_as_before).
        """
        unplaced: dict[str, _Unplaced] = {}  # by queue
        for state, index in self.waiting_guaranteed:
            earlier = unplaced.get(state.queue.id)
            if earlier is not None and earlier.memo is not self._memo():
                self._settle_again(state, earlier)
            if not self._settle_one(state, index):
                if earlier is None:
                    earlier = unplaced[state.queue.id] = _Unplaced()
                earlier.add(state, index)
            if earlier is not None:
                earlier.memo = self._memo()

    def _settle_again(self, state: QueueState, earlier: _Unplaced) -> None:
        """Ask a queue's tasks that settling found no room for again, in their order, now that the cycle has
        changed. Of each kind, the first one is asked: where it finds no room still, so would the rest of
        its kind (and they may not pass it); where it is placed, the next of its kind is asked."""
        heads = [(indexes[0], kind) for kind, indexes in earlier.kinds.items()]
        heapq.heapify(heads)
        while heads:
            index, kind = heapq.heappop(heads)
            if not self._settle_one(state, index):
                continue
            indexes = earlier.kinds[kind]
            indexes.popleft()
            if indexes:
                heapq.heappush(heads, (indexes[0], kind))
            else:
                del earlier.kinds[kind]

    def _settle_one(self, state: QueueState, index: int) -> bool:
        """Settling's second chance for one guaranteed task: whether it was placed."""
        task, policy = state.tasks[index], state.policy
        kind = (policy.id, state.profile.id, task.sharing, task.size, task.time_limit)
        alike = self.remember_refusals and task.id not in self.holding and task.id not in self.planned_heads
        if alike and kind in self._memo().unsettled:
            return False
        if self._ineligible(policy, task) is not None or not self._guaranteed(policy, task):
            return False
        pool = self._place(state.profile, policy, task) or self._reclaim(state.profile, policy, task)
        if pool is None:
            if alike:
                self._memo().unsettled.add(kind)
            return False
        self._commit(task, policy, pool, band=GUARANTEED)
        self.placed_now[task.id] = (state, index)
        del self.reasons[task.id]
        return True

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
        state: QueueState,
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
            if not state.planned and index == state.head():
                # The head borrows, and guaranteed work behind it goes first: if it is blocked, plan it
                # now, so that its own policy's work does not delay it (backfill).
                self._plan_if_blocked(state, task)
            index = state.pending(index + 1)

    def _key(self, state: QueueState, task: Task) -> tuple[object, ...]:
        profile, policy = state.profile, state.policy
        home = self._home(profile, task)
        execution = profile.execution_priority.get(home, 0) if home is not None else 0
        return (
            -state.queue.queuing_priority,
            -execution,
            -task.priority,
            self.policy_used[policy.id] / (policy.reservation or 1),  # fair share (reservations are >= 0)
            task.submitted_at,
            task.id,
        )

    def _consider(self, state: QueueState, index: int, band: int) -> None:
        task, policy = state.tasks[index], state.policy
        kind = (state.queue.id, band, task.sharing, task.size, task.time_limit)
        if self._refused_as_before(state, index, kind):
            return
        version = self.version
        is_head = state.head() == index
        refusal = self._ineligible(policy, task)
        if refusal is not None:
            if is_head and not state.planned and refusal.code == "policy_limit":
                self._plan_head(state, task, band)
            if task.id in self.planned_heads:
                refusal = self._planned_reason(task, refusal)
            self._give_up(state, index, refusal)
            if band == BORROWING and not state.profile.strict_fifo and refusal.code != "reserved_for_head":
                self._refuse_the_same_behind(state, index)
            return
        pool = self._place(state.profile, policy, task)
        if pool is None and band == GUARANTEED:
            pool = self._reclaim(state.profile, policy, task)
        if pool is not None:
            self._commit(task, policy, pool, band=band)
            state.done[index] = True
            self.placed_now[task.id] = (state, index)
            return
        if band == GUARANTEED:
            self.waiting_guaranteed.append((state, index))
        if is_head and not state.planned and self._plan_head(state, task, band):
            pass  # a planned start protects the head better than a hold: the gap stays usable
        elif is_head and self._starving(state.profile, task):
            home = self._home(state.profile, task)
            if home is not None and home not in self.held:
                self.held[home] = task.id
                self.holding.add(task.id)
                self.version += 1  # a held pool changes what others may place and reclaim
        # Given up on for the whole cycle: free capacity only shrinks from here, so the borrowing band
        # would not find room the guaranteed band did not.
        reason = self._planned_reason(task, self._no_room_reason(state.profile, task))
        self._give_up(state, index, reason)
        if self.version == version and task.id not in self.planned_heads and task.id not in self.holding:
            self._memo().refused[kind] = reason

    def _refused_as_before(self, state: QueueState, index: int, kind: tuple[object, ...]) -> bool:
        """Refuse the task at `index` as the last one of its kind in its queue was refused for room, where
        that is sure to be its answer and all its turn would do: nothing in the cycle has changed since (its
        usage, holds and planned starts: `version`), and its turn could do nothing else (plan the queue's
        head, hold a pool as a starving head, or answer for a pool held or planned for it). Every answer of
        that refusal (the policy's and the tenant's room, the pools' room, reclaim, the reason) depends on
        nothing else, so a long queue of alike tasks is refused in a lookup each instead of the whole
        question (at a million queued, most of a cycle). False, having done nothing, otherwise."""
        refused = self._memo().refused.get(kind) if self.remember_refusals else None
        if refused is None or not state.planned:
            return False
        task = state.tasks[index]
        if task.id in self.planned_heads or task.id in self.holding:
            return False
        if self._starving(state.profile, task):
            home = self._home(state.profile, task)
            if home is not None and home not in self.held:
                return False
        if kind[1] == GUARANTEED:
            self.waiting_guaranteed.append((state, index))
        self._give_up(state, index, refused)
        return True

    def _plan_if_blocked(self, state: QueueState, task: Task) -> None:
        """A head the guaranteed band passes over (it would borrow): plan it if it is blocked, by its
        policy's limit or for room, before the work behind it is placed."""
        refusal = self._ineligible(state.policy, task)
        if refusal is not None and refusal.code != "policy_limit":
            return  # the tenant's share, or a reservation for another head: nothing to plan here
        if refusal is None and self._place(state.profile, state.policy, task) is not None:
            return  # it may still go, in the borrowing band
        self._plan_head(state, task, BORROWING)

    def _refuse_the_same_behind(self, state: QueueState, index: int) -> None:
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

    def _give_up(self, state: QueueState, index: int, reason: Reason) -> None:
        task = state.tasks[index]
        self.reasons[task.id] = reason
        state.done[index] = True
        if state.profile.strict_fifo:
            state.blocked_by = task.id

    def _ineligible(self, policy: Policy, task: Task) -> Reason | None:
        reserved = self._policy_reservation_refusal(policy, task)
        if reserved is not None:
            return reserved
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

    def _place(self, profile: Profile, policy: Policy, task: Task) -> str | None:
        if task.size > self._room(profile, task.sharing):
            return None
        for pool_id in profile.pools:
            pool = self.pools.get(pool_id)
            if pool is None or not self._fits_kind(pool, task):
                continue
            if self.held.get(pool_id, task.id) != task.id:
                continue
            if self._binds(pool_id, task, policy) and not self.reserved[pool_id].admits(task, self.now):
                continue
            if pool.capacity - self.pool_used[pool_id] >= task.size:
                return pool_id
        return None

    def _commit(self, task: Task, policy: Policy, pool: str, *, band: int) -> None:
        self.placements[task.id] = Placement(task.id, pool)
        ends_at = self.now + task.time_limit if task.time_limit is not None else None
        allocation = Allocation(task.id, task.queue, pool, task.size, self.now, ends_at)
        self._book(task, policy, pool, ends_at)
        self.in_pool[pool][task.id] = allocation
        self.policy_pools[policy.id].add(pool)
        self.placed_in_queue[task.queue].append(allocation)
        self.pool_used[pool] += task.size
        self.policy_used[policy.id] += task.size
        self.total_used += task.size
        self.version += 1
        if self.held.get(pool) == task.id:
            del self.held[pool]
            self.holding.discard(task.id)


class _Unplaced:
    """One queue's tasks that settling found no room for, by kind (sharing, size, time limit), each kind's in
    queue order; and the memo of the cycle's version when they were last asked (a new memo: something
    changed since)."""

    def __init__(self) -> None:
        self.kinds: dict[tuple[object, ...], deque[int]] = {}
        self.memo: Memo | None = None

    def add(self, state: QueueState, index: int) -> None:
        task = state.tasks[index]
        self.kinds.setdefault((task.sharing, task.size, task.time_limit), deque()).append(index)
