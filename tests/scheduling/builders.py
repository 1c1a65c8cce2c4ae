"""Compact builders for engine snapshots in tests. Sizes are given in GPUs and converted exactly."""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction

from apps.scheduling.engine import (
    Allocation,
    Policy,
    Pool,
    Profile,
    Queue,
    Sharing,
    Snapshot,
    Task,
    units,
)

Size = int | str | Fraction


def pool(name: str, gpus: int, *, online: bool = True, sharing: Iterable[Sharing] = (Sharing.WHOLE,)) -> Pool:
    return Pool(name, units(gpus), online, frozenset({Sharing.WHOLE, *sharing}), name)


def profile(
    name: str,
    pools: Iterable[str],
    *,
    strict: bool = False,
    starvation: float | None = None,
    execution: dict[str, int] | None = None,
) -> Profile:
    return Profile(name, tuple(pools), execution or {}, strict, starvation)


def policy(name: str, reservation: Size, limit: Size) -> Policy:
    return Policy(name, units(reservation), units(limit), name)


def queue(name: str, policy_name: str, profile_name: str, priority: int = 0) -> Queue:
    return Queue(name, policy_name, profile_name, priority)


def task(
    name: str,
    queue_name: str,
    size: Size,
    *,
    at: float = 0.0,
    priority: int = 0,
    sharing: Sharing = Sharing.WHOLE,
    limit: float | None = None,
) -> Task:
    return Task(name, queue_name, units(size), at, sharing, priority, limit)


def running(
    name: str, queue_name: str, pool_name: str, size: Size, *, started: float = 0.0, ends: float | None = None
) -> Allocation:
    return Allocation(name, queue_name, pool_name, units(size), started, ends)


def snapshot(
    *,
    pools: Iterable[Pool],
    profiles: Iterable[Profile],
    policies: Iterable[Policy],
    queues: Iterable[Queue],
    queued: Iterable[Task] = (),
    allocations: Iterable[Allocation] = (),
    now: float = 1000.0,
    share: Size | None = None,
) -> Snapshot:
    return Snapshot(
        now,
        tuple(pools),
        tuple(profiles),
        tuple(policies),
        tuple(queues),
        tuple(queued),
        tuple(allocations),
        None if share is None else units(share),
    )
