"""Incremental cycles: one tenant's queues kept between cycles, and a cycle that decides only what changed.

A full cycle considers every queued task. Between two cycles of a deep queue, little changes: a few
arrivals, a few finishes. `Resident` keeps the tenant's queued and running work and the last cycle's
outcome, is told of each change as it happens, and runs the next cycle over the compute resources (queues)
a change could move:

- a queue where a task arrived or was withdrawn (its order changed);
- a queue whose profile has a pool where work finished (room there grew); a queue whose policy's work
  finished elsewhere, where that could move it: the queue's last decision refused a task for its policy
  (its limit, or room kept for its blocked head), or the policy now uses less than its reservation (a task
  may now start as guaranteed, and take back borrowed GPUs); any queue where the tenant's share binds,
  when any work finished.

Every other queue keeps the outcome of the last cycle: its tasks' reasons, and the pools its heads hold
(starvation) or are planned to start in (backfill), which bind the queues that are decided again as they
did before. Running work is kept with its usage per pool and policy, so a cycle never walks it whole.

This is the event-driven requeueing of production schedulers (Kubernetes' scheduling queue moves an
unschedulable pod back only on an event that could make it schedulable; Kueue requeues an inadmissible
workload when capacity in its cohort frees), with their periodic flush: a full cycle runs at least every
`full_every` seconds and on request, since some changes come with time alone (a head crossing its
starvation bound, a planned start coming near) and a queue not decided again keeps a reason that was
true when it was given.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace

from .cycle import _Cycle
from .model import Allocation, Decision, Reason, Snapshot, Task
from .state import Plans, Usage

# The reasons a policy gives: its limit, and room kept for its blocked head (the same code is also given for
# a pool's room kept for a head, which only makes the set larger than it need be).
POLICY_BOUND = frozenset({"policy_limit", "reserved_for_head"})


class Resident:
    """One tenant's queues, running work and last outcome, kept between cycles (see the module)."""

    def __init__(self, snapshot: Snapshot, *, full_every: float = 30.0) -> None:
        """Start from a snapshot; its configuration (pools, profiles, policies, queues, share) is fixed for
        the life of this object: after a change to it, start a new one."""
        self.config = replace(snapshot, queued=(), running=())
        self.full_every = full_every
        self.queue_policy = {queue.id: queue.policy for queue in snapshot.queues}
        profile_pools = {profile.id: profile.pools for profile in snapshot.profiles}
        self.queues_of_pool: dict[str, set[str]] = defaultdict(set)
        self.queues_of_policy: dict[str, set[str]] = defaultdict(set)
        for queue in snapshot.queues:
            self.queues_of_policy[queue.policy].add(queue.id)
            for pool in profile_pools.get(queue.profile, ()):
                self.queues_of_pool[pool].add(queue.id)
        self.reservation = {policy.id: policy.reservation for policy in snapshot.policies}
        # Queues whose last decision refused a task for its policy (their limit, or room kept for a head).
        self.policy_bound: set[str] = set()
        self.queued: dict[str, dict[str, Task]] = defaultdict(dict)  # queue -> its tasks by id
        self.queue_of: dict[str, str] = {}  # queued task -> its queue
        self.running: dict[str, Allocation] = {}
        self.usage = Usage.of((), self.queue_policy)
        self.reasons: dict[str, Reason] = {}  # every queued task's reason from the cycle that last decided it
        self.plans = Plans({}, {}, {})
        self.last_full: float | None = None
        self._touched: set[str] = set()  # queues with arrivals or withdrawals since the last cycle
        self._freed_pools: set[str] = set()
        self._freed_policies: set[str] = set()
        self.submit(snapshot.queued)
        self.start(snapshot.running)

    # -- what happened since the last cycle ------------------------------------------------------------

    def submit(self, tasks: Iterable[Task]) -> None:
        """Tasks that entered the queue (new, or requeued after a preemption or a lost run)."""
        for task in tasks:
            self.queued[task.queue][task.id] = task
            self.queue_of[task.id] = task.queue
            self._touched.add(task.queue)

    def withdraw(self, task_ids: Iterable[str]) -> None:
        """Queued tasks that left the queue without a cycle placing them (cancelled, held back)."""
        for task_id in task_ids:
            queue = self.queue_of.pop(task_id, None)
            if queue is not None:
                del self.queued[queue][task_id]
                self.reasons.pop(task_id, None)
                self._touched.add(queue)

    def start(self, allocations: Iterable[Allocation]) -> None:
        """Work that holds GPUs without this object's cycles having placed it (the snapshot's running)."""
        for allocation in allocations:
            self.running[allocation.task] = allocation
            self.usage.add(allocation, self.queue_policy.get(allocation.queue))

    def finish(self, task_ids: Iterable[str]) -> None:
        """Running work that let its GPUs go (ended, or a preempted run that stopped)."""
        for task_id in task_ids:
            allocation = self.running.pop(task_id, None)
            if allocation is None:
                continue
            policy = self.queue_policy.get(allocation.queue)
            self.usage.remove(allocation, policy)
            self._freed_pools.add(allocation.pool)
            if policy is not None:
                self._freed_policies.add(policy)

    def put(self, task_id: str, now: Task | Allocation | None) -> None:
        """A task as it is now (queued, holding GPUs, or neither), whatever this object held of it: a change
        read back from the rows, told again or for the first time. Nothing moves where nothing changed; a run
        whose times alone changed keeps its usage and frees nothing."""
        queue = self.queue_of.get(task_id)
        was_queued = None if queue is None else self.queued[queue][task_id]
        was_running = self.running.get(task_id)
        if now is not None and now in (was_queued, was_running):
            return
        if (
            isinstance(now, Allocation)
            and was_running is not None
            and (now.queue, now.pool, now.size) == (was_running.queue, was_running.pool, was_running.size)
        ):
            self.running[task_id] = now
            return
        if was_queued is not None:
            self.withdraw([task_id])
        if was_running is not None:
            self.finish([task_id])
        if isinstance(now, Task):
            self.submit([now])
        elif isinstance(now, Allocation):
            self.start([now])

    # -- cycles -----------------------------------------------------------------------------------------

    def snapshot(self, now: float) -> Snapshot:
        """The whole state as a snapshot (what a full cycle decides on)."""
        return replace(
            self.config,
            now=now,
            queued=tuple(task for tasks in self.queued.values() for task in tasks.values()),
            running=tuple(self.running.values()),
        )

    def affected(self) -> set[str]:
        """The queues the changes since the last cycle could move (see the module)."""
        queues = set(self._touched)
        for pool in self._freed_pools:
            queues |= self.queues_of_pool.get(pool, set())
        for policy in self._freed_policies:
            of_policy = self.queues_of_policy.get(policy, set())
            if self.usage.policy_used[policy] < self.reservation.get(policy, 0):
                queues |= of_policy
            else:
                queues |= of_policy & self.policy_bound
        if self.config.tenant_share is not None and self._freed_pools:
            queues |= set(self.queued)
        return {queue for queue in queues if self.queued.get(queue)}

    def cycle(self, now: float, *, full: bool = False) -> Decision:
        """Decide, and apply the decision to the kept state. A full cycle (on request, the first, or
        `full_every` after the last full one) decides every queued task; an incremental one only the queues
        in `affected()`, and its `reasons` are theirs alone (`self.reasons` holds every queued task's)."""
        if full or self.last_full is None or now - self.last_full >= self.full_every:
            self.last_full = now
            return self._decide(self.snapshot(now), None)
        queues = self.affected()
        carried = Plans(
            {pool: head for pool, head in self.plans.held.items() if self._kept(head, queues)},
            {pool: plan for pool, plan in self.plans.reserved.items() if self._kept(plan.task, queues)},
            {key: plan for key, plan in self.plans.policy_reserved.items() if self._kept(plan.task, queues)},
        )
        queued = tuple(task for queue in sorted(queues) for task in self.queued[queue].values())
        return self._decide(replace(self.config, now=now, queued=queued), carried)

    def _kept(self, head: str, queues: set[str]) -> bool:
        queue = self.queue_of.get(head)
        return queue is not None and queue not in queues

    def _decide(self, snapshot: Snapshot, carried: Plans | None) -> Decision:
        cycle = _Cycle(snapshot, self.usage, carried)
        decision = cycle.run()
        self.plans = Plans(dict(cycle.held), dict(cycle.reserved), dict(cycle.policy_reserved))
        self._touched.clear()
        self._freed_pools.clear()
        self._freed_policies.clear()
        for preemption in decision.preemptions:  # its GPUs now serve the task it was preempted for
            victim = self.running.pop(preemption.victim, None)
            if victim is not None:
                self.usage.remove(victim, self.queue_policy.get(victim.queue))
        for placement in decision.placements:
            queue = self.queue_of.pop(placement.task)
            task = self.queued[queue].pop(placement.task)
            self.reasons.pop(task.id, None)
            ends = None if task.time_limit is None else snapshot.now + task.time_limit
            self.start([Allocation(task.id, queue, placement.pool, task.size, snapshot.now, ends)])
        self.reasons.update(decision.reasons)
        self.policy_bound -= {task.queue for task in snapshot.queued}
        self.policy_bound.update(
            self.queue_of[task]
            for task, reason in decision.reasons.items()
            if reason.code in POLICY_BOUND and task in self.queue_of
        )
        return decision
