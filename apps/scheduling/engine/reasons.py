"""The reasons a cycle gives every task it leaves queued, in words a person can read."""

from __future__ import annotations

from functools import partial

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
