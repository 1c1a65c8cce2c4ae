"""Incremental cycles in the worker: a tenant with a deep queue is kept between its cycles, and a cycle reads
only the task rows changed since the last one and decides only the queues they could move.

A full cycle reads every queued and running task (a tenth of a second per 15,000 rows here) and decides
every queue; at 100,000 queued that is seconds a cycle, however little changed. A worker process keeps,
for each tenant whose queue holds at least `KLIQUE_CYCLE_INCREMENTAL_FROM` tasks, the engine's `Resident`
(apps/scheduling/engine/resident.py: the queues, the running work with its usage, the last cycle's holds
and plans) beside the reasons its queued tasks show and the horizon of its last read
(apps/scheduling/reads.py). The next cycle of that tenant in that process:

- reads the configuration as every cycle does; where anything of it differs (a pool online or offline, a
  stopping run let go, a profile, policy or compute resource edited, the tenant's share), it reads
  everything afresh, as it does when `KLIQUE_CYCLE_FULL_SECONDS` have passed since the last full read, and
  for a tenant it does not keep;
- otherwise reads the rows changed since its horizon (its own placements among them) and tells the
  `Resident` each task as it is now; tasks a spent budget holds back are taken out of its queues while
  they are held;
- runs the `Resident`'s cycle over the queues those changes could move, and writes its decision as a full
  cycle's is written (`cycle._apply`).

What is kept is taken out of the process's keeping for the length of a cycle and put back only when the
cycle's transaction commits, so a cycle that fails or is rolled back leaves nothing behind that the
database does not hold; the next cycle reads everything. Several workers may keep the same tenant: each
catches up from the rows, whoever wrote them. The advisory lock of the cycle keeps two from deciding at
once.

Between two full reads a queue not decided again keeps the reasons it was given (true when given), and a
reason written to a queued task by anything but a cycle without a change of its state or reason code is
seen at the next full read.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from django.conf import settings

from apps.scheduling import engine, reads

if TYPE_CHECKING:
    from tenants.models import Tenant

TENANTS_KEPT = 8  # per worker process, the most recently scheduled first (about 450 bytes a task each)


@dataclass
class Kept:
    """One tenant between its cycles."""

    resident: engine.Resident
    configuration: engine.Snapshot  # as `reads.configuration` gave it at the last full read
    horizon: int  # of the last read of rows
    shown: reads.Shown  # every queued task's reason, as the rows and this process's writes say
    held: dict[str, engine.Task]  # queued tasks a spent budget holds back, out of the resident's queues
    read_at: float  # when everything was last read


@dataclass(frozen=True)
class Outcome:
    """A cycle's decision, the reasons its queued tasks show (which writing the decision brings up to date),
    how many tasks were queued, and what to keep after the cycle commits (None: nothing)."""

    decision: engine.Decision
    shown: reads.Shown
    queued: int
    kept: Kept | None


_kept: OrderedDict[str, Kept] = OrderedDict()
_lock = threading.Lock()


def _take(schema_name: str) -> Kept | None:
    with _lock:
        return _kept.pop(schema_name, None)


def keep(schema_name: str, kept: Kept | None) -> None:
    """After the cycle's commit: keep the tenant for its next cycle (None: keep nothing)."""
    if kept is None:
        return
    with _lock:
        _kept[schema_name] = kept
        while len(_kept) > TENANTS_KEPT:
            _kept.popitem(last=False)


def forget(schema_name: str | None = None) -> None:
    """Keep nothing of the tenant (of any tenant, without a name): its next cycle reads everything."""
    with _lock:
        if schema_name is None:
            _kept.clear()
        else:
            _kept.pop(schema_name, None)


def decide(tenant: Tenant, now: datetime, held: frozenset[str]) -> Outcome:
    """The cycle's decision for the tenant at `now`, the queued tasks in `held` left waiting. Call inside
    the cycle's transaction, after its lock; pass the outcome's `kept` to `keep` once it commits."""
    configuration = reads.configuration(tenant, now)
    kept = _take(tenant.schema_name)
    moment = now.timestamp()
    if (
        kept is not None
        and kept.configuration == configuration
        and moment - kept.read_at < settings.KLIQUE_CYCLE_FULL_SECONDS
    ):
        _catch_up(kept, moment, held)
        queued = sum(map(len, kept.resident.queued.values()))
        return Outcome(kept.resident.cycle(moment), kept.shown, queued, kept)

    read = reads.tasks(now)
    state = reads.whole(configuration, read, now, held)
    if len(read.queued) < settings.KLIQUE_CYCLE_INCREMENTAL_FROM:
        return Outcome(engine.schedule(state), read.shown, len(state.queued), None)
    kept = Kept(
        engine.Resident(state, full_every=math.inf),  # this module reads everything when it is time
        configuration,
        read.horizon,
        dict(read.shown),
        {task.id: task for task in read.queued if task.id in held},
        moment,
    )
    return Outcome(kept.resident.cycle(moment, full=True), kept.shown, len(state.queued), kept)


def _catch_up(kept: Kept, now: float, held: frozenset[str]) -> None:
    """Tell the kept tenant what its rows say now, and which queued tasks its budgets hold back."""
    rows, kept.horizon = reads.changed_since(kept.horizon)
    resident = kept.resident
    for row in rows:
        key = row[0]
        task = reads.as_engine(row, now)
        if isinstance(task, engine.Task):
            kept.shown[key] = reads.shows(row)
            if key in held:
                kept.held[key] = task
                task = None
            else:
                kept.held.pop(key, None)
        else:
            kept.shown.pop(key, None)
            kept.held.pop(key, None)
        resident.put(key, task)
    for key in [key for key in kept.held if key not in held]:  # released since
        resident.put(key, kept.held.pop(key))
    for key in held:  # held since
        queue = resident.queue_of.get(key)
        if queue is not None:
            kept.held[key] = resident.queued[queue][key]
            resident.put(key, None)
