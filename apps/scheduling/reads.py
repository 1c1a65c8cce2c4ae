"""What a scheduling cycle reads of a tenant: its configuration as the engine sees it, its tasks in full, and
the tasks changed since an earlier read (for incremental cycles, apps/scheduling/incremental.py).

The tasks are read as plain rows: ids as text and times as epoch seconds, as the engine takes them.
Django's rows, UUIDs and time zones cost more than the rest of a cycle at a deep queue (a 5,000-task queue
read in a quarter to a half of the time).

**Changes.** Every change to what the engine sees of a task stamps its row with the id of the transaction
that made it (`changed_xid`, set by a trigger: migration scheduling 0013). A read records the oldest
transaction still running when it read (its snapshot's xmin, its *horizon*); the rows changed since are
those stamped at or after that horizon. A transaction that had not committed when a read was made has an
id at least its horizon, so its rows are in the next read, whenever it commits; a row read twice is read
as it is now, and applying it again changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import connection
from django.db.models import Sum

from apps.resources.models import (
    MIG_METHODS,
    ComputeResource,
    Pool,
    ProfilePool,
    ResourcePolicy,
    ResourceProfile,
    SharingMethod,
    online,
)
from apps.scheduling import engine
from apps.scheduling.agents import agents
from apps.scheduling.models import ACTIVE_STATES, Task, TaskRun, TaskState

if TYPE_CHECKING:
    from tenants.models import Tenant

Shown = dict[str, tuple[str, str]]  # a queued task's id -> the reason code and text it shows now

_SHARING = {sharing.value: sharing for sharing in engine.Sharing}
_ACTIVE = frozenset(ACTIVE_STATES)

# What a task is to the engine, with the reason it shows. The queued read and the read of changes share it.
_COLUMNS = """
id::text, state, compute_resource_id::text, pool_id::text, size_units,
extract(epoch FROM submitted_at)::float8, sharing, priority, time_limit_seconds,
extract(epoch FROM coalesce(started_at, placed_at))::float8, extract(epoch FROM started_at)::float8,
reason_code, reason
"""


def _with_horizon(condition: str) -> str:
    """The rows meeting `condition` beside the horizon of the statement's own snapshot (one row of nulls
    beside it where none does)."""
    return f"""
SELECT horizon.reached, {_COLUMNS}
  FROM (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS reached) AS horizon
  LEFT JOIN {Task._meta.db_table} ON {condition}
"""  # noqa: S608 (the model's own table; every value is a parameter)


_QUEUED = _with_horizon("state = %s AND compute_resource_id IS NOT NULL")
_CHANGED = _with_horizon("changed_xid >= %s")  # every row stamped at or after a horizon
_RUNNING = f"""
SELECT {_COLUMNS} FROM {Task._meta.db_table} WHERE state = ANY(%s) AND pool_id IS NOT NULL
"""  # noqa: S608 (the model's own table; every value is a parameter)

Row = tuple[
    str, str, str | None, str | None, int, float, str, int, int | None, float | None, float | None, str, str
]


def _stopping_units() -> dict[str, int]:
    """Units still held per pool by runs the plane has stopped (aborted, preempted) whose connected agent
    has not yet let them go: their GPUs are free only when the agent says so."""
    connected = agents().connected()
    rows = (
        TaskRun.objects.filter(released_at=None, agent_id__in=connected)
        .exclude(stop="")
        .values("pool_id")
        .annotate(units=Sum("size_units"))
    )
    return {str(row["pool_id"]): row["units"] for row in rows if row["pool_id"] is not None}


def _configuration_sql() -> str:
    pool, profile, entry = Pool._meta.db_table, ResourceProfile._meta.db_table, ProfilePool._meta.db_table
    return f"""
SELECT id::text, name, capacity_gpus, sharing ? %s, sharing ?| %s, last_heartbeat_at,
       heartbeat_timeout_seconds
  FROM {pool} ORDER BY name;
SELECT profile.id::text, profile.strict_fifo, profile.starvation_seconds,
       array_remove(array_agg(entry.pool_id::text ORDER BY entry.position), NULL),
       array_remove(array_agg(entry.execution_priority ORDER BY entry.position), NULL)
  FROM {profile} AS profile LEFT JOIN {entry} AS entry ON entry.profile_id = profile.id
 GROUP BY profile.id ORDER BY profile.name;
SELECT id::text, reservation_units, limit_units, name FROM {ResourcePolicy._meta.db_table} ORDER BY name;
SELECT id::text, policy_id::text, profile_id::text, queuing_priority
  FROM {ComputeResource._meta.db_table} ORDER BY name
"""  # noqa: S608 (the models' own tables; every value is a parameter)


# The configuration in one message, as plain rows (a tenant of a thousand pools and profiles would otherwise
# build several thousand model instances and UUIDs every cycle): pools with whether they offer fractions
# and MIG, profiles with their pools in order, policies, compute resources.
_CONFIGURATION = _configuration_sql()


def configuration(tenant: Tenant, now: datetime) -> engine.Snapshot:
    """The tenant's pools (as they are now: online, less what stopping runs still hold), profiles, policies,
    compute resources and share, as a snapshot with no tasks at time 0: two reads made at times when
    nothing of this changed are equal."""
    with connection.cursor() as cursor:
        cursor.execute(
            _CONFIGURATION, [SharingMethod.FRACTION.value, sorted(method.value for method in MIG_METHODS)]
        )
        pool_rows = cursor.fetchall()
        cursor.nextset()
        profile_rows = cursor.fetchall()
        cursor.nextset()
        policy_rows = cursor.fetchall()
        cursor.nextset()
        queue_rows = cursor.fetchall()
    stopping = _stopping_units()
    refusing = agents().refusing()  # an autoscaler that cannot start instances: its pool takes no work
    pools = []
    for pk, name, capacity_gpus, fraction, mig, last_heartbeat_at, heartbeat_timeout_seconds in pool_rows:
        sharing = {engine.Sharing.WHOLE}
        if fraction:
            sharing.add(engine.Sharing.FRACTION)
        if mig:
            sharing.add(engine.Sharing.MIG)
        pools.append(
            engine.Pool(
                pk,
                max(0, capacity_gpus * engine.UNITS_PER_GPU - stopping.get(pk, 0)),
                online(last_heartbeat_at, heartbeat_timeout_seconds, now) and pk not in refusing,
                frozenset(sharing),
                name,
            )
        )
    return engine.Snapshot(
        now=0.0,
        pools=tuple(pools),
        profiles=tuple(
            engine.Profile(
                pk,
                tuple(order),
                dict(zip(order, priorities, strict=True)),
                strict_fifo,
                float(starvation_seconds) if starvation_seconds else None,
            )
            for pk, strict_fifo, starvation_seconds, order, priorities in profile_rows
        ),
        policies=tuple(engine.Policy(*row) for row in policy_rows),
        queues=tuple(engine.Queue(*row) for row in queue_rows),
        queued=(),
        running=(),
        tenant_share=None if tenant.gpu_share is None else tenant.gpu_share * engine.UNITS_PER_GPU,
    )


def _waiting(row: Row) -> engine.Task:
    key, _, resource, _, size, submitted, sharing, priority, limit = row[:9]
    return engine.Task(key, resource or "", size, submitted, _SHARING[sharing], priority, limit)


def _holding(row: Row, now: float) -> engine.Allocation:
    key, _, resource, pool, size, _, _, _, limit, begun, started = row[:11]
    return engine.Allocation(
        key,
        resource,  # type: ignore[arg-type]  # a removed compute resource's work still holds its GPUs
        pool or "",
        size,
        begun if begun is not None else now,
        # A run not started yet ends its limit after it starts, at the earliest now.
        None if limit is None else (started if started is not None else now) + limit,
    )


def shows(row: Row) -> tuple[str, str]:
    """The reason code and text a task's row shows."""
    return row[11], row[12]


def as_engine(row: Row, now: float) -> engine.Task | engine.Allocation | None:
    """A task's row as the engine sees it: queued, holding GPUs, or neither (ended, or with nowhere to be)."""
    state, resource, pool = row[1:4]
    if state == TaskState.QUEUED:
        return None if resource is None else _waiting(row)
    if state in _ACTIVE and pool is not None:
        return _holding(row, now)
    return None


@dataclass(frozen=True)
class Tasks:
    """The tenant's queued and running tasks as the engine sees them, the reasons the queued show, and the
    horizon of the read (see the module)."""

    queued: tuple[engine.Task, ...]
    running: tuple[engine.Allocation, ...]
    shown: Shown
    horizon: int


def _horizon_and_rows(rows: list[tuple[Any, ...]]) -> tuple[int, list[Row]]:
    return int(rows[0][0]), [row[1:] for row in rows if row[1] is not None]


def tasks(now: datetime) -> Tasks:
    """Every queued and running task. Call inside the cycle's transaction."""
    moment = now.timestamp()
    with connection.cursor() as cursor:
        cursor.execute(_QUEUED, [TaskState.QUEUED])
        horizon, waiting = _horizon_and_rows(cursor.fetchall())
        cursor.execute(_RUNNING, [list(ACTIVE_STATES)])
        holding = cursor.fetchall()
    reasons: dict[tuple[str, str], tuple[str, str]] = {}  # one copy of each reason, however many show it
    return Tasks(
        tuple(map(_waiting, waiting)),
        tuple(_holding(row, moment) for row in holding),
        {row[0]: reasons.setdefault(shows(row), shows(row)) for row in waiting},
        horizon,
    )


def changed_since(since: int) -> tuple[list[Row], int]:
    """The rows of tasks changed at or after the horizon `since`, and this read's horizon."""
    with connection.cursor() as cursor:
        cursor.execute(_CHANGED, [since])
        horizon, rows = _horizon_and_rows(cursor.fetchall())
    return rows, horizon


def whole(
    configuration: engine.Snapshot, read: Tasks, now: datetime, held: frozenset[str]
) -> engine.Snapshot:
    """The configuration with every task read, at `now`, without the queued tasks in `held`."""
    return replace(
        configuration,
        now=now.timestamp(),
        queued=tuple(task for task in read.queued if task.id not in held),
        running=read.running,
    )


def snapshot(
    tenant: Tenant, now: datetime, *, held: Iterable[str] = frozenset()
) -> tuple[engine.Snapshot, Shown]:
    """The tenant's whole state as the engine sees it (without the queued tasks in `held`), and the reasons
    its queued tasks show now (read in the same pass, so the cycle writes only the reasons that changed).
    Call inside the cycle's transaction."""
    held = frozenset(held)
    read = tasks(now)
    state = whole(configuration(tenant, now), read, now, held)
    return state, {key: shown for key, shown in read.shown.items() if key not in held}
