"""Backfill with time limits (EASY): a queue's blocked head is planned a start, from the time limits of the
work in its way, and the pool and the policy room it will need then are reserved for it. Work considered
after it may use them now only if its own time limit ends it by that start, or it fits in what will still
be free beside the head then. Rule 5b of docs/scheduling.md."""

from __future__ import annotations

import time

from .model import Policy, Profile, Reason, Task
from .state import CycleState, QueueState, Reservation
from .units import describe


def moment(at: float) -> str:
    """A planned start as a person reads it, in UTC: the same text from cycle to cycle while the plan
    holds, so that a waiting task's reason is not rewritten as time passes."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(at))


class Backfilling(CycleState):
    # -- planning ---------------------------------------------------------------------------------------

    def _plan_head(self, state: QueueState, task: Task, band: int) -> bool:
        """Plan the queue's blocked head (its first task this cycle that cannot go, for room or for its
        policy's limit) once: the earliest moment, as the work in its way reaches its time limits, at which
        its policy is under its limit with it and a pool of its order has room for it (the first in order
        on a tie). Reserve that pool and its policy's room for it; False when no moment can be planned
        (work without a limit in the way, or every pool held or reserved for others)."""
        state.planned = True
        policy = state.policy
        pools = self._open_pools(state.profile, task)
        if not pools or policy.id in self.policy_reserved:
            return False  # (one planned head per policy: its room is kept for that one)
        policy_free = policy.limit - self.policy_used[policy.id]
        free = {pool_id: self.pools[pool_id].capacity - self.pool_used[pool_id] for pool_id in pools}
        # What frees when, from the work with a time limit: (when, pool, size for the pool, for the policy).
        events: list[tuple[float, str, int, int]] = []
        # Only the pools it could go to and those its policy has work in hold what frees for it.
        for pool_id in sorted(free.keys() | self.policy_pools[policy.id]):
            for item in self.in_pool[pool_id].values():
                if item.ends_at is None or item.task in self.preempted:
                    continue
                ours = self.queue_policy.get(item.queue) == policy.id
                if ours or pool_id in free:
                    events.append((max(item.ends_at, self.now), pool_id, item.size, item.size if ours else 0))
        events.sort(key=lambda event: event[0])
        index = 0
        while index < len(events):
            at = events[index][0]
            while index < len(events) and events[index][0] == at:  # everything that ends at this moment
                _, pool_id, pool_size, policy_size = events[index]
                policy_free += policy_size
                if pool_id in free:
                    free[pool_id] += pool_size
                index += 1
            if policy_free < task.size:
                continue
            chosen = next((pool_id for pool_id in pools if free[pool_id] >= task.size), None)
            if chosen is not None:
                self.reserved[chosen] = Reservation(
                    task.id, task.size, at, free[chosen] - task.size, band, policy.id
                )
                self.policy_reserved[policy.id] = Reservation(
                    task.id, task.size, at, policy_free - task.size, band, policy.id
                )
                self.planned_heads.add(task.id)
                self.version += 1  # reservations change what others may place and reclaim
                return True
        return False

    def _open_pools(self, profile: Profile, task: Task) -> list[str]:
        """The pools of the profile's order the task could be planned in: not held or reserved for others."""
        return [
            pool_id
            for pool_id in profile.pools
            if (pool := self.pools.get(pool_id)) is not None
            and self._fits_kind(pool, task)
            and pool_id not in self.reserved
            and self.held.get(pool_id, task.id) == task.id
        ]

    # -- what a reservation lets others do ---------------------------------------------------------------

    def _binds_policy(self, policy: Policy, task: Task) -> bool:
        """A policy's room kept for its blocked head binds all of the policy's other work."""
        reservation = self.policy_reserved.get(policy.id)
        return reservation is not None and reservation.task != task.id

    def _policy_reservation_refusal(self, policy: Policy, task: Task) -> Reason | None:
        """Why the task may not take its policy's room now: it would delay the head it is reserved for."""
        if not self._binds_policy(policy, task):
            return None
        reservation = self.policy_reserved[policy.id]
        if reservation.admits(task, self.now):
            return None
        return self._reason(
            ("policy-reserved", policy.id, reservation.task, reservation.extra, task.size),
            "reserved_for_head",
            lambda: (
                f"Policy {policy.label}'s room is reserved for task {reservation.task}, planned to start at "
                f"{moment(reservation.start)} as the work in its way reaches its time limits "
                f"({describe(reservation.extra)} beside it then); this task would delay it. A task whose "
                "time limit ends it by then may run now."
            ),
        )

    def _book(self, task: Task, policy: Policy, pool: str, ends_at: float | None) -> None:
        """A placement's effect on the reservations: a planned head placed frees its own; work that will
        still run at a head's planned start uses up what is free beside it there (a guaranteed task of
        another policy may take more: that head is then planned afresh next cycle)."""
        if task.id in self.planned_heads:
            self._unplan(task.id)
        for table, key in ((self.reserved, pool), (self.policy_reserved, policy.id)):
            reservation = table.get(key)
            if reservation is None or (ends_at is not None and ends_at <= reservation.start):
                continue
            reservation.extra -= task.size
            if reservation.extra < 0:
                self._unplan(reservation.task)

    def _unplan(self, head: str) -> None:
        self.planned_heads.discard(head)
        for table in (self.reserved, self.policy_reserved):
            for key in [key for key, reservation in table.items() if reservation.task == head]:
                del table[key]
        self.version += 1
