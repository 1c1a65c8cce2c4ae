"""Replay the Philly GPU trace through Klique's scheduler, beside FIFO and a no-borrowing configuration.

One policy per virtual cluster, its reservation in proportion to that cluster's share of the trace's GPU
time, its limit the whole capacity (it may borrow anything idle); one profile over the pools; tasks sized
from the trace. The same jobs replay through plain FIFO (one strict-FIFO queue, no policies) and through
Klique with every limit at its reservation (no borrowing). Prints GPU utilization, p50/p95 queue wait,
mean job completion time (JCT), reservation-violation hours (a policy waiting below its reservation with
work that fits while others borrow, summed over policies), preemptions, and each replay's wall time.

Per cluster, its p95 wait under Klique, under plain FIFO on the pooled GPUs, and siloed (the cluster
alone on GPUs equal to its reservation, best-effort FIFO), from the same run: the target is every
cluster's p95 under Klique below its siloed p95 and at most 1.5x its p95 under pooled FIFO (waits are
whole cycles: a p95 within one cycle counts as met).

Backfill: one best-effort queue over the pooled GPUs with a starvation bound of an hour, replayed without
time limits and with each job's limit at twice its duration rounded up to the hour (as users overstate
them); the mean wait of jobs of 16 GPUs or more with backfill should be at most half of without.

The last line is Klique's mean JCT over FIFO's.
Usage: .venv/bin/python bench/trace_replay.py [--trace PATH] [--gpus 640] [--pools 4] [--interval 60]
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from collections import defaultdict
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from apps.scheduling.engine import Policy, Pool, Profile, Queue, units
from apps.scheduling.engine.simulate import (
    SUMMARY_HEADERS,
    Job,
    Outcome,
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


STARVATION_SECONDS = 3600.0
BIG_JOB_GPUS = 16


def siloed(klique: Setup, jobs: list[Job], interval: float) -> dict[str, Outcome]:
    """Each cluster alone on GPUs equal to its reservation (one pool), best-effort FIFO."""
    outcomes = {}
    for policy in klique.policies:
        if policy.reservation <= 0:
            continue
        setup = Setup(
            f"{policy.id} siloed",
            (Pool("silo", policy.reservation, name="silo"),),
            (Profile("silo", ("silo",)),),
            (Policy(policy.id, policy.reservation, policy.reservation),),
            (Queue(policy.id, policy.id, "silo"),),
        )
        outcomes[policy.id] = replay(
            setup, [job for job in jobs if job.group == policy.id], interval=interval
        )
    return outcomes


def cluster_rows(
    klique: Setup, outcomes: list[Outcome], silos: dict[str, Outcome], cycle: float
) -> tuple[list[list[str]], int]:
    """Per cluster: p95 waits side by side, and how many clusters miss the targets."""
    rows, misses = [], 0
    for policy in klique.policies:
        under_klique = outcomes[0].group_wait_percentile(policy.id, 0.95)
        under_fifo = outcomes[1].group_wait_percentile(policy.id, 0.95)
        silo = silos.get(policy.id)
        under_silo = silo.wait_percentile(0.95) if silo is not None and silo.waits else None
        # Waits are measured in whole cycles: within one cycle of each other, two waits are the same.
        klique_wait = under_klique or 0.0
        beats_silo = under_silo is None or klique_wait < under_silo or klique_wait <= cycle
        near_fifo = under_fifo is None or klique_wait <= 1.5 * under_fifo + cycle
        misses += not (beats_silo and near_fifo)
        rows.append(
            [
                policy.id,
                f"{policy.reservation // units(1)}",
                str(len(outcomes[0].group_waits.get(policy.id, []))),
                _hours(under_klique),
                _hours(under_fifo),
                _hours(under_silo) if silo is not None else "no reservation",
                "yes" if beats_silo and near_fifo else "NO",
            ]
        )
    return rows, misses


def _hours(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.2f}"


def backfill(klique: Setup, jobs: list[Job], interval: float) -> tuple[Outcome, Outcome]:
    """Best-effort FIFO with its starvation bound, without and with time limits (backfill)."""
    capacity = sum(pool.capacity for pool in klique.pools)
    setup = Setup(
        "best-effort FIFO",
        klique.pools,
        (Profile("one", tuple(pool.id for pool in klique.pools), starvation_seconds=STARVATION_SECONDS),),
        (Policy("all", capacity, capacity),),
        (Queue("one", "all", "one"),),
    )
    plain = [replace(job, queue="one") for job in jobs]
    limited = [replace(job, time_limit=3600.0 * math.ceil(2 * job.duration / 3600.0)) for job in plain]
    return (
        replay(setup, plain, interval=interval),
        replay(replace(setup, name="best-effort FIFO + backfill"), limited, interval=interval),
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

    silos = siloed(klique, by_cluster, args.interval)
    per_cluster, misses = cluster_rows(klique, outcomes, silos, args.interval)
    print("\nWait p95 per cluster (hours): Klique, plain FIFO on the pooled GPUs, the cluster siloed")
    print(
        table(
            ["cluster", "reserved GPUs", "jobs", "Klique", "pooled FIFO", "siloed", "on target"], per_cluster
        )
    )
    print(f"{misses} of {len(per_cluster)} clusters miss the target (below siloed, at most 1.5x pooled FIFO)")

    without, with_backfill = backfill(klique, by_cluster, args.interval)
    big = units(BIG_JOB_GPUS)
    print(
        f"\nBackfill: mean wait of jobs of {BIG_JOB_GPUS} GPUs or more, best-effort FIFO with a starvation "
        "bound"
    )
    print(
        table(
            ["configuration", f"mean wait >= {BIG_JOB_GPUS} GPUs h", "wait p95 h", "mean JCT h", "timed out"],
            [
                [
                    outcome.name,
                    f"{outcome.mean_wait_at_least(big) / 3600:.2f}",
                    f"{outcome.wait_percentile(0.95) / 3600:.2f}",
                    f"{outcome.mean_completion_time / 3600:.2f}",
                    str(outcome.timed_out),
                ]
                for outcome in (without, with_backfill)
            ],
        )
    )
    if without.mean_wait_at_least(big):
        share = with_backfill.mean_wait_at_least(big) / without.mean_wait_at_least(big)
        print(f"backfill / without: {share:.3f} (target: at most 0.5)\n")
    klique_jct, fifo_jct = outcomes[0].mean_completion_time, outcomes[1].mean_completion_time
    print(
        f"ratio: {klique_jct / fifo_jct:.3f} "
        f"({klique_jct / 3600:.1f} h / {fifo_jct / 3600:.1f} h mean JCT, Klique / FIFO)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
