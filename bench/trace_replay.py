"""Replay the Philly GPU trace through Klique's scheduler, beside FIFO and a no-borrowing configuration.

One policy per virtual cluster, its reservation in proportion to that cluster's share of the trace's GPU
time, its limit the whole capacity (it may borrow anything idle); one profile over the pools; tasks sized
from the trace. The same jobs replay through plain FIFO (one strict-FIFO queue, no policies) and through
Klique with every limit at its reservation (no borrowing). Prints GPU utilization, p50/p95 queue wait,
mean job completion time (JCT), reservation-violation hours (a policy waiting below its reservation with
work that fits while others borrow, summed over policies), preemptions, and each replay's wall time.
The last line is Klique's mean JCT over FIFO's.
Usage: .venv/bin/python bench/trace_replay.py [--trace PATH] [--gpus 640] [--pools 4] [--interval 60]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

from apps.scheduling.engine import Policy, Pool, Profile, Queue, units
from apps.scheduling.engine.simulate import (
    SUMMARY_HEADERS,
    Job,
    Setup,
    replay,
    summary_rows,
    with_limits_at_reservations,
)
from klique.tables import table

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "philly.csv"


def read_trace(path: Path) -> list[tuple[str, float, float, int]]:
    """(cluster, submit seconds, duration seconds, GPUs) per job."""
    rows = []
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            submit = datetime.strptime(row["timestamp"], "%Y-%m-%d %H:%M:%S").timestamp()
            rows.append((row["cluster"], submit, float(row["duration"]), int(row["num_gpus"])))
    return rows


def klique_setup(trace: list[tuple[str, float, float, int]], gpus: int, pool_count: int) -> Setup:
    per_pool = gpus // pool_count
    pools = tuple(Pool(f"pool{i}", units(per_pool), name=f"pool{i}") for i in range(pool_count))
    profile = Profile("any", tuple(pool.id for pool in pools))
    gpu_time: dict[str, float] = defaultdict(float)
    for cluster, _, duration, size in trace:
        gpu_time[cluster] += duration * size
    total = sum(gpu_time.values())
    policies = tuple(
        Policy(cluster, units(int(gpus * seconds / total)), units(per_pool * pool_count), cluster)
        for cluster, seconds in sorted(gpu_time.items())
    )
    queues = tuple(Queue(policy.id, policy.id, "any") for policy in policies)
    return Setup("Klique", pools, (profile,), policies, queues)


def fifo_setup(klique: Setup) -> Setup:
    capacity = sum(pool.capacity for pool in klique.pools)
    profile = Profile("fifo", tuple(pool.id for pool in klique.pools), strict_fifo=True)
    return Setup(
        "FIFO",
        klique.pools,
        (profile,),
        (Policy("all", capacity, capacity),),
        (Queue("fifo", "all", "fifo"),),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--gpus", type=int, default=640, help="capacity in all")
    parser.add_argument("--pools", type=int, default=4)
    parser.add_argument("--interval", type=float, default=60.0, help="simulated seconds between cycles")
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N jobs by submit time")
    args = parser.parse_args()
    if not args.trace.exists():
        print(f"No trace at {args.trace}; pass --trace.", file=sys.stderr)
        return 2
    trace = sorted(read_trace(args.trace), key=lambda row: row[1])
    if args.limit:
        trace = trace[: args.limit]
    klique = klique_setup(trace, args.gpus, args.pools)
    by_cluster = [
        Job(f"j{i}", cluster, submit, duration, units(size), cluster)
        for i, (cluster, submit, duration, size) in enumerate(trace)
    ]
    as_fifo = [Job(job.id, "fifo", job.submit, job.duration, job.size, job.group) for job in by_cluster]
    # Every replay is judged against the same entitlements: each cluster's reservation under Klique.
    entitlements = {policy.id: policy.reservation for policy in klique.policies}
    outcomes, walls = [], []
    for setup, jobs in (
        (klique, by_cluster),
        (fifo_setup(klique), as_fifo),
        (with_limits_at_reservations(klique, "no borrowing"), by_cluster),
    ):
        started = time.perf_counter()
        outcomes.append(replay(setup, jobs, interval=args.interval, entitlements=entitlements))
        walls.append(time.perf_counter() - started)
    print(
        f"{len(trace)} jobs of {args.trace.name}; {args.gpus} GPUs in {args.pools} pools; "
        f"{len(klique.policies)} policies; a cycle every {args.interval:g} simulated seconds"
    )
    rows = [
        [*row, f"{wall:.1f}", str(outcome.cycles)]
        for row, wall, outcome in zip(summary_rows(outcomes), walls, outcomes, strict=True)
    ]
    print(table([*SUMMARY_HEADERS, "wall s", "cycles"], rows))
    klique_jct, fifo_jct = outcomes[0].mean_completion_time, outcomes[1].mean_completion_time
    print(
        f"ratio: {klique_jct / fifo_jct:.3f} "
        f"({klique_jct / 3600:.1f} h / {fifo_jct / 3600:.1f} h mean JCT, Klique / FIFO)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
