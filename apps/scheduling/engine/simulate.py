"""Replay a stream of jobs through the engine in simulated time, and measure what happens.

Used by bench/trace_replay.py (the public Philly trace) and by `klique simulate` (a tenant's own history
against a proposed configuration). Pure: no Django, no I/O, no wall clock.

Model: at each scheduling instant (every `interval` simulated seconds in which something arrived or
finished) the engine runs on the current snapshot; placements start at once and run for their remaining
duration; a preempted job goes back to its queue keeping its submit time and the work it had done (as if
it checkpointed at the preemption). A job larger than every pool it may use is refused at submit, as the
control plane refuses it. A job with a time limit gives the engine its planned end (backfill), and a run
that reaches its limit is stopped there and counted as timed out.
"""

from __future__ import annotations

import heapq
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from .cycle import schedule
from .model import Allocation, Policy, Pool, Profile, Queue, Snapshot, Task


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    queue: str  # the compute resource it is submitted to
    submit: float  # seconds
    duration: float  # seconds of work
    size: int  # units
    group: str = ""  # whose entitlement the job counts against when reservations are compared
    time_limit: float | None = None  # seconds a run may last; None: no limit


@dataclass(frozen=True)
class Setup:
    """A configuration to replay against: everything of a snapshot but the tasks."""

    name: str
    pools: tuple[Pool, ...]
    profiles: tuple[Profile, ...]
    policies: tuple[Policy, ...]
    queues: tuple[Queue, ...]
    tenant_share: int | None = None


@dataclass
class Outcome:
    name: str
    jobs: int = 0
    refused: int = 0
    finished: int = 0
    preemptions: int = 0
    cycles: int = 0
    gpu_unit_seconds: float = 0.0
    capacity_units: int = 0
    span_seconds: float = 0.0
    waits: list[float] = field(default_factory=list)
    completion_times: list[float] = field(default_factory=list)
    reservation_violation_seconds: float = 0.0
    timed_out: int = 0  # runs stopped at their time limit
    sized_waits: list[tuple[int, float]] = field(default_factory=list)  # (units, wait) per job
    group_waits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    group_preemptions: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # suffered
    group_gpu_unit_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    group_borrowed_unit_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    job_waits: dict[str, float] = field(default_factory=dict)  # job id -> its wait, for jobs that started

    def mean_wait_at_least(self, size: int) -> float:
        """The mean queue wait of jobs of at least `size` units."""
        waits = [wait for units, wait in self.sized_waits if units >= size]
        return statistics.fmean(waits) if waits else 0.0

    def group_wait_percentile(self, group: str, fraction: float) -> float | None:
        return percentile(self.group_waits.get(group, []), fraction)

    @property
    def utilization(self) -> float:
        if not self.capacity_units or not self.span_seconds:
            return 0.0
        return self.gpu_unit_seconds / (self.capacity_units * self.span_seconds)

    def wait_percentile(self, fraction: float) -> float:
        return percentile(self.waits, fraction) or 0.0

    @property
    def mean_completion_time(self) -> float:
        return statistics.fmean(self.completion_times) if self.completion_times else 0.0


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """The value at `fraction` of `values` in order (the nearest rank at or above it); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@dataclass
class _Live:
    job: Job
    remaining: float
    started_at: float | None = None  # of the current run
    first_start: float | None = None
    pool: str | None = None


def replay(
    setup: Setup, jobs: Iterable[Job], *, interval: float = 60.0, entitlements: dict[str, int] | None = None
) -> Outcome:
    """Run `jobs` through `setup`; the engine decides every `interval` seconds that anything changed.

    Reservation violations are measured against `entitlements` (group -> units, jobs naming their group),
    so that setups without those policies (plain FIFO) are judged by the same yardstick; by default the
    setup's own policies are the groups.
    """
    return _Replay(setup, sorted(jobs, key=lambda job: (job.submit, job.id)), interval, entitlements).run()


class _Replay:
    def __init__(
        self, setup: Setup, arrivals: list[Job], interval: float, entitlements: dict[str, int] | None
    ) -> None:
        self.setup, self.arrivals, self.interval = setup, arrivals, interval
        self.outcome = Outcome(
            setup.name, capacity_units=sum(pool.capacity for pool in setup.pools if pool.online)
        )
        self.largest = _largest_pool_per_queue(setup)
        self.live: dict[str, _Live] = {}
        self.queued: dict[str, Task] = {}
        self.running: dict[str, Allocation] = {}
        self.finishing: list[tuple[float, str, float]] = []  # (time, job, run start); stale entries skipped
        self.next_arrival = 0
        self.start = arrivals[0].submit if arrivals else 0.0
        if entitlements is None:
            policy_of = {queue.id: queue.policy for queue in setup.queues}
            self.entitlements = {policy.id: policy.reservation for policy in setup.policies}
            self.group_of: Callable[[Job], str] = lambda job: policy_of[job.queue]
        else:
            self.entitlements = entitlements
            self.group_of = lambda job: job.group

    def run(self) -> Outcome:
        now = self.start
        while self.next_arrival < len(self.arrivals) or self.finishing or self.queued:
            moments = [self.finishing[0][0]] if self.finishing else []
            if self.next_arrival < len(self.arrivals):
                moments.append(self.arrivals[self.next_arrival].submit)
            if not moments:
                break  # queued work that can never start: nothing will ever change
            upcoming = min(moments)
            # Decide at the first multiple of the interval at or after the next event.
            now = max(now, self.start + self.interval * -(-(upcoming - self.start) // self.interval))
            self._finish_until(now)
            self._arrive_until(now)
            if self.queued:
                self._cycle(now)
        return self.outcome

    def _finish_until(self, now: float) -> None:
        while self.finishing and self.finishing[0][0] <= now:
            at, job_id, run_start = heapq.heappop(self.finishing)
            state = self.live.get(job_id)
            if state is None or state.started_at != run_start or job_id not in self.running:
                continue
            allocation = self.running.pop(job_id)
            self.outcome.gpu_unit_seconds += allocation.size * (at - run_start)
            self.outcome.group_gpu_unit_seconds[self.group_of(state.job)] += allocation.size * (
                at - run_start
            )
            self.outcome.finished += 1
            self.outcome.timed_out += state.remaining > at - run_start  # stopped at its limit
            self.outcome.completion_times.append(at - state.job.submit)
            self.outcome.span_seconds = max(self.outcome.span_seconds, at - self.start)
            del self.live[job_id]

    def _arrive_until(self, now: float) -> None:
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival].submit <= now:
            job = self.arrivals[self.next_arrival]
            self.next_arrival += 1
            self.outcome.jobs += 1
            if job.size > self.largest.get(job.queue, 0):
                self.outcome.refused += 1
                continue
            self.live[job.id] = _Live(job, job.duration)
            self.queued[job.id] = _task(job)

    def _cycle(self, now: float) -> None:
        setup, outcome = self.setup, self.outcome
        decision = schedule(
            Snapshot(
                now,
                setup.pools,
                setup.profiles,
                setup.policies,
                setup.queues,
                tuple(self.queued.values()),
                tuple(self.running.values()),
                setup.tenant_share,
            )
        )
        outcome.cycles += 1
        for preemption in decision.preemptions:
            allocation = self.running.pop(preemption.victim)
            state = self.live[preemption.victim]
            ran = now - (state.started_at or now)
            outcome.gpu_unit_seconds += allocation.size * ran
            outcome.group_gpu_unit_seconds[self.group_of(state.job)] += allocation.size * ran
            outcome.group_preemptions[self.group_of(state.job)] += 1
            state.remaining -= ran
            state.started_at = None
            outcome.preemptions += 1
            self.queued[preemption.victim] = _task(state.job)
        for placement in decision.placements:
            task = self.queued.pop(placement.task)
            state = self.live[placement.task]
            state.started_at = now
            if state.first_start is None:
                state.first_start = now
                outcome.waits.append(now - state.job.submit)
                outcome.sized_waits.append((state.job.size, now - state.job.submit))
                outcome.group_waits[self.group_of(state.job)].append(now - state.job.submit)
                outcome.job_waits[state.job.id] = now - state.job.submit
            limit = state.job.time_limit
            ends_at = None if limit is None else now + limit
            self.running[task.id] = Allocation(task.id, task.queue, placement.pool, task.size, now, ends_at)
            run_for = max(state.remaining, 0.0) if limit is None else min(max(state.remaining, 0.0), limit)
            heapq.heappush(self.finishing, (now + run_for, task.id, now))
        usage: dict[str, int] = defaultdict(int)
        for task_id, allocation in self.running.items():
            usage[self.group_of(self.live[task_id].job)] += allocation.size
        for group, used in usage.items():
            above = used - self.entitlements.get(group, 0)
            if above > 0:
                outcome.group_borrowed_unit_seconds[group] += above * self.interval
        outcome.reservation_violation_seconds += self.interval * _violations(
            [self.live[task_id].job for task_id in self.queued],
            [(self.live[task_id].job, allocation.size) for task_id, allocation in self.running.items()],
            self.group_of,
            self.entitlements,
        )


def _task(job: Job) -> Task:
    return Task(job.id, job.queue, job.size, job.submit, time_limit=job.time_limit)


def _violations(
    queued: Iterable[Job],
    running: Iterable[tuple[Job, int]],
    group_of: Callable[[Job], str],
    entitlements: dict[str, int],
) -> int:
    """How many groups wait below their entitlement with work that fits in it while others use more than
    theirs."""
    usage: dict[str, int] = defaultdict(int)
    for job, size in running:
        usage[group_of(job)] += size
    borrowing = {group for group, used in usage.items() if used > entitlements.get(group, 0)}
    if not borrowing:
        return 0
    waiting = set()
    for job in queued:
        group = group_of(job)
        if usage[group] + job.size <= entitlements.get(group, 0) and borrowing - {group}:
            waiting.add(group)
    return len(waiting)


def _largest_pool_per_queue(setup: Setup) -> dict[str, int]:
    capacity = {pool.id: pool.capacity for pool in setup.pools if pool.online}
    profiles = {profile.id: profile for profile in setup.profiles}
    return {
        queue.id: max((capacity.get(pool, 0) for pool in profiles[queue.profile].pools), default=0)
        for queue in setup.queues
    }


def with_limits_at_reservations(setup: Setup, name: str) -> Setup:
    """The same setup where no policy may borrow: each limit is its reservation."""
    return replace(
        setup,
        name=name,
        policies=tuple(replace(policy, limit=policy.reservation) for policy in setup.policies),
    )


def summary_rows(outcomes: Sequence[Outcome]) -> list[list[str]]:
    rows = []
    for outcome in outcomes:
        rows.append(
            [
                outcome.name,
                f"{outcome.utilization:.1%}",
                f"{outcome.wait_percentile(0.5) / 60:.1f}",
                f"{outcome.wait_percentile(0.95) / 3600:.1f}",
                f"{outcome.mean_completion_time / 3600:.1f}",
                f"{outcome.reservation_violation_seconds / 3600:.0f}",
                str(outcome.preemptions),
                f"{outcome.finished}/{outcome.jobs - outcome.refused}",
            ]
        )
    return rows


SUMMARY_HEADERS = [
    "configuration",
    "GPU utilization",
    "wait p50 min",
    "wait p95 h",
    "mean JCT h",
    "resv. violation h",
    "preemptions",
    "finished",
]
