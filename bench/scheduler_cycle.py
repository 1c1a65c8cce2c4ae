"""Time of one scheduling cycle of the pure engine, against a plain sort of the same queued tasks.

A tenant with 1,000 pools, 500 policies, 1,000 compute resources and 20,000 running tasks; 1k, 10k and
100k queued tasks of mixed sizes (whole GPUs, fractions, MIG slices, multi-GPU). For each size it prints
the median cycle time of a few runs, the time of `sorted()` over the same queued tasks with the engine's
in-queue order as key, and how each grows. The last line is the ratio at 100k. Before it, at 100k queued
and at rest (full cycles until one places nothing), the incremental cycle (engine/resident.py) after a
few arrivals and finishes (5 of each), beside a full cycle of the same state.
With --million, one size instead: 1,000,000 queued and 100,000 running on 5,000 pools.
Usage: .venv/bin/python bench/scheduler_cycle.py [--repeat 3] [--seed 1] [--million]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from fractions import Fraction

from apps.scheduling.engine import (
    Allocation,
    Policy,
    Pool,
    Profile,
    Queue,
    Resident,
    Sharing,
    Snapshot,
    Task,
    schedule,
    task_order,
    units,
)

SIZES = [
    (units(Fraction(1, 7)), Sharing.MIG),
    (units("0.5"), Sharing.FRACTION),
    (units(1), Sharing.WHOLE),
    (units(2), Sharing.WHOLE),
    (units(4), Sharing.WHOLE),
    (units(8), Sharing.WHOLE),
    (units(16), Sharing.WHOLE),
]


def tenant(
    rng: random.Random, queued_count: int, running_count: int = 20_000, pool_count: int = 1000
) -> Snapshot:
    pools = tuple(
        Pool(
            f"pool{i}",
            units(rng.choice([8, 16, 32, 64])),
            rng.random() > 0.02,
            frozenset({Sharing.WHOLE, Sharing.FRACTION, Sharing.MIG})
            if i % 3 == 0
            else frozenset({Sharing.WHOLE}),
        )
        for i in range(pool_count)
    )
    profiles = tuple(
        Profile(
            f"profile{i}",
            tuple(rng.sample([pool.id for pool in pools], rng.randint(2, 5))),
            {},
            rng.random() < 0.2,
            rng.choice([None, 3600.0]),
        )
        for i in range(pool_count // 5)
    )
    policies = []
    for i in range(500):
        reservation = rng.randint(4, 64) * (pool_count // 1000)  # the default: as many GPUs as pools
        policies.append(Policy(f"policy{i}", units(reservation), units(reservation * rng.randint(1, 4))))
    queues = tuple(
        Queue(f"queue{i}", policies[i % 500].id, rng.choice(profiles).id, rng.randint(0, 3))
        for i in range(1000)
    )
    free = {pool.id: pool.capacity for pool in pools}
    profile_pools = {profile.id: profile.pools for profile in profiles}
    running: list[Allocation] = []
    i = 0
    while len(running) < running_count:
        i += 1
        queue = rng.choice(queues)
        size, _ = rng.choice(SIZES[:4])
        pool_id = rng.choice(profile_pools[queue.profile]) if i % 7 else rng.choice(pools).id
        if free[pool_id] >= size:
            free[pool_id] -= size
            running.append(Allocation(f"run{i}", queue.id, pool_id, size, rng.uniform(0, 10_000)))
    queued = []
    for i in range(queued_count):
        size, sharing = rng.choice(SIZES)
        queued.append(
            Task(f"task{i}", rng.choice(queues).id, size, rng.uniform(0, 10_000), sharing, rng.randint(0, 2))
        )
    return Snapshot(10_000.0, pools, profiles, tuple(policies), queues, tuple(queued), tuple(running), None)


def timed(function, repeat: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--million",
        action="store_true",
        help="one size only: 1,000,000 queued and 100,000 running on 5,000 pools, with 1,000 profiles and "
        "policies five times larger (about 2 GB of memory)",
    )
    args = parser.parse_args()
    if args.million:
        return million(args.seed, args.repeat)
    rows = []
    for count in (1_000, 10_000, 100_000):
        snapshot = tenant(random.Random(args.seed), count)
        decision = schedule(snapshot)
        cycle_ms = timed(lambda snapshot=snapshot: schedule(snapshot), args.repeat)
        sort_ms = timed(lambda snapshot=snapshot: sorted(snapshot.queued, key=task_order), args.repeat)
        rows.append((count, cycle_ms, sort_ms, len(decision.placements), len(decision.preemptions)))
    print(
        f"1,000 pools, 500 policies, 1,000 compute resources, {len(snapshot.running)} running; "
        f"median of {args.repeat}"
    )
    print(f"{'queued':>8} {'cycle ms':>10} {'sorted() ms':>12} {'ratio':>7} {'placed':>7} {'preempted':>10}")
    for count, cycle_ms, sort_ms, placed, preempted in rows:
        ratio = cycle_ms / sort_ms
        print(f"{count:>8} {cycle_ms:>10.1f} {sort_ms:>12.1f} {ratio:>7.2f} {placed:>7} {preempted:>10}")
    full_ms, incremental_ms, decided = incremental(snapshot, args.repeat, random.Random(args.seed))
    print(
        f"incremental cycle at {len(snapshot.queued):,} queued, 5 arrivals and 5 finishes: "
        f"{incremental_ms:.1f} ms ({decided:,.0f} tasks decided again) against a full cycle of the same "
        f"state {full_ms:.1f} ms: {incremental_ms / full_ms:.1%} (target under 5%)"
    )
    (small, small_ms, _, _, _), (large, large_ms, large_sort, _, _) = rows[0], rows[-1]
    nlogn = (large * math.log(large)) / (small * math.log(small))
    print(f"growth 1k -> 100k: cycle x{large_ms / small_ms:.0f}, n log n would be x{nlogn:.0f}")
    print(f"ratio: {large_ms / large_sort:.2f} ({large_ms:.1f} ms / {large_sort:.1f} ms at 100k queued)")
    return 0


def incremental(snapshot: Snapshot, repeat: int, rng: random.Random) -> tuple[float, float, float]:
    """Full and incremental cycle times (median ms) at rest, and how many tasks an incremental one decided."""
    resident = Resident(snapshot, full_every=math.inf)
    now = snapshot.now
    for _ in range(10):  # a cycle's preemptions can open room the next one uses: go on until nothing moves
        now += 1
        decision = resident.cycle(now, full=True)
        if not decision.placements and not decision.preemptions:
            break
    full_ms = timed(lambda: resident.cycle(now, full=True), repeat)
    spans, decided = [], []
    queues = [queue.id for queue in snapshot.queues]
    for step in range(max(repeat, 5)):
        now += 1
        resident.finish(rng.sample(sorted(resident.running), 5))
        size, sharing = SIZES[2]
        resident.submit(
            Task(f"new{step}-{k}", rng.choice(queues), size, now, sharing, rng.randint(0, 2))
            for k in range(5)
        )
        started = time.perf_counter()
        decision = resident.cycle(now)
        spans.append((time.perf_counter() - started) * 1000)
        decided.append(len(decision.reasons) + len(decision.placements))
    return full_ms, statistics.median(spans), statistics.median(decided)


def million(seed: int, repeat: int) -> int:
    started = time.perf_counter()
    snapshot = tenant(random.Random(seed), 1_000_000, running_count=100_000, pool_count=5000)
    built = time.perf_counter() - started
    decision = schedule(snapshot)
    cycle_ms = timed(lambda: schedule(snapshot), repeat)
    sort_ms = timed(lambda: sorted(snapshot.queued, key=task_order), repeat)
    print(
        f"5,000 pools, 500 policies, 1,000 compute resources, {len(snapshot.running)} running, "
        f"{len(snapshot.queued)} queued (built in {built:.1f} s); median of {repeat}"
    )
    print(f"cycle {cycle_ms:.0f} ms, sorted() {sort_ms:.0f} ms; placed {len(decision.placements)}, "
          f"preempted {len(decision.preemptions)}")  # fmt: skip
    print(f"ratio: {cycle_ms / sort_ms:.2f} ({cycle_ms:.0f} ms / {sort_ms:.0f} ms at 1,000,000 queued)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
