"""Preemption within one cycle: a guaranteed task that fits nowhere takes back borrowed capacity, from
running work (a preemption) or from this cycle's own borrowing placements (which are simply not made).

Victims are in one pool of the task's profile order, of policies above their reservation that stay at or
above it, lowest queuing priority first, then most recently started; only if that lets the task start
there, never one victim twice (SCHEDULING.md, rule 6). Kept beside the cycle as Kueue keeps preemption/
beside its scheduler."""

from __future__ import annotations

from collections import defaultdict

from .model import (
    Allocation,
    Placement,
    Policy,
    Preemption,
    Profile,
    Task,
)
from .state import CycleState


class Preempting(CycleState):
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
        for allocation in self.in_pool[pool_id].values():
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
            if self._binds(pool_id, task, policy):
                continue  # reserved for a head considered before it: no preemption that could delay it
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
        self.in_pool[pool_id].pop(victim.task, None)
        if not later:
            self._unplace(victim.task, for_policy)
            return
        moved_to = max(later, key=lambda allocation: self.placed_now[allocation.task][1])
        self.preempted.discard(victim.task)
        self.preempted.add(moved_to.task)
        moved = Allocation(victim.task, victim.queue, moved_to.pool, victim.size, self.now)
        in_moved_pool = self.in_pool[moved_to.pool]  # the victim takes the later placement's place
        del in_moved_pool[moved_to.task]
        in_moved_pool[victim.task] = moved
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
        for allocation in self.in_pool[pool_id].values():
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
