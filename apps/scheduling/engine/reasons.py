"""The reasons a cycle gives every task it leaves queued, in words a person can read."""

from __future__ import annotations

from functools import partial

from .backfill import moment
from .model import (
    Profile,
    Reason,
    Task,
)
from .state import CycleState
from .units import describe


class Explaining(CycleState):
    def _starving(self, profile: Profile, task: Task) -> bool:
        bound = profile.starvation_seconds
        return not profile.strict_fifo and bound is not None and self.now - task.submitted_at > bound

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
        reserved = [
            (pool_id, reservation)
            for pool_id in profile.pools
            if (reservation := self.reserved.get(pool_id)) is not None and reservation.task != task.id
        ]
        if reserved and task.size <= self._room(profile, task.sharing):
            pool_id, reservation = min(reserved, key=lambda item: item[1].start)
            return self._reason(
                ("reserved", profile.id, reservation.task, task.size),
                "reserved_for_head",
                lambda: (
                    f"Pool {self.pools[pool_id].label} is reserved for task {reservation.task}, planned to "
                    f"start at {moment(reservation.start)} as the work there reaches its time limits; this "
                    "task would delay it. A task whose time limit ends it by then may run in the gap."
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

    def _planned_reason(self, task: Task, fallback: Reason) -> Reason:
        """A blocked head's reason, with its planned start where a pool is reserved for it."""
        if task.id not in self.planned_heads:
            return fallback
        planned = [(pool_id, r) for pool_id, r in self.reserved.items() if r.task == task.id]
        if not planned:
            return fallback
        pool_id, reservation = planned[0]
        return Reason(
            fallback.code,
            f"{fallback.message} Pool {self.pools[pool_id].label} is reserved for it: planned to start at "
            f"{moment(reservation.start)}, as the work there reaches its time limits.",
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
