"""The engine's input and output: frozen plain data. All sizes are integer units (see units.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Sharing(StrEnum):
    """How a task uses GPUs, and which of these a pool supports."""

    WHOLE = "whole"
    FRACTION = "fraction"
    MIG = "mig"


@dataclass(frozen=True, slots=True)
class Pool:
    id: str
    capacity: int  # units; whole GPUs only (a multiple of UNITS_PER_GPU)
    online: bool = True
    sharing: frozenset[Sharing] = frozenset({Sharing.WHOLE})
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.id


@dataclass(frozen=True, slots=True)
class Profile:
    """Where a compute resource's tasks may run: pools in order, and how its queue is disciplined."""

    id: str
    pools: tuple[str, ...]
    # Precedence of this profile's tasks in each of its pools when profiles compete for one pool.
    execution_priority: Mapping[str, int] = field(default_factory=dict)
    strict_fifo: bool = False
    # Best-effort FIFO: a head that has waited longer than this makes the scheduler hold capacity for it.
    starvation_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    """A group's guarantee (reservation) and cap (limit), in units."""

    id: str
    reservation: int
    limit: int
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.id


@dataclass(frozen=True, slots=True)
class Queue:
    """A compute resource: the queue of one (policy, profile) pair."""

    id: str
    policy: str
    profile: str
    queuing_priority: int = 0


@dataclass(frozen=True, slots=True)
class Task:
    id: str
    queue: str
    size: int
    submitted_at: float
    sharing: Sharing = Sharing.WHOLE
    priority: int = 0
    time_limit: float | None = None  # seconds it may run; None: no limit, its end cannot be planned


@dataclass(frozen=True, slots=True)
class Allocation:
    """A task that holds GPUs in a pool (placed, dispatching or running)."""

    task: str
    queue: str
    pool: str
    size: int
    started_at: float
    ends_at: float | None = None  # when its time limit stops it at the latest; None: no limit


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    pools: tuple[Pool, ...]
    profiles: tuple[Profile, ...]
    policies: tuple[Policy, ...]
    queues: tuple[Queue, ...]
    queued: tuple[Task, ...]
    running: tuple[Allocation, ...]
    tenant_share: int | None = None  # units; None: no provider cap


@dataclass(frozen=True, slots=True)
class Placement:
    task: str
    pool: str


@dataclass(frozen=True, slots=True)
class Preemption:
    victim: str
    pool: str
    for_task: str


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a task is still queued: a code for programs and a sentence for people."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Decision:
    placements: tuple[Placement, ...]
    preemptions: tuple[Preemption, ...]
    reasons: Mapping[str, Reason]  # every task left queued, by id
    # Blocked heads with a planned start (backfill): task id -> (pool id, when). Nothing placed this cycle
    # keeps a planned head from starting then.
    planned: Mapping[str, tuple[str, float]] = field(default_factory=dict)
