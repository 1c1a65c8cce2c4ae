"""Reads of the fleet: what agents report, a pool's task and run as the protocol looks them up (locked, for
the write that follows), and a task's logs, metrics and outputs."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connection
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum

from apps.core import rows
from apps.core.ids import as_uuid
from apps.fleet.models import Agent, CloudInstance, TaskReport
from apps.resources.models import SCALES_FROM_ZERO, Pool
from apps.scheduling.models import Task, TaskRun

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class Reported:
    """A pool's connected agents (workers) and what they report, summed; a figure no agent reports is
    None, not 0."""

    workers: int = 0
    cpus: int | None = None
    cpus_in_use: int | None = None
    nodes: int | None = None
    gpus: tuple[dict[str, Any], ...] = ()  # per GPU class and resource, summed over its agents
    problems: tuple[str, ...] = ()  # "agent: what stops it", for each agent that says


NONE_REPORTED = Reported()


def agents_by_pool() -> dict[Any, Reported]:
    """Reported, per pool id, for the pools with a connected agent."""
    rows = (
        Agent.objects.filter(connected=True)
        .values("pool_id")
        .annotate(workers=Count("id"), cpus=Sum("cpus"), cpus_in_use=Sum("cpus_in_use"), nodes=Sum("nodes"))
        .values_list("pool_id", "workers", "cpus", "cpus_in_use", "nodes")
    )
    found = {pool: Reported(*figures) for pool, *figures in rows}
    gpus: dict[Any, dict[tuple[str, str], list[int]]] = {}
    problems: dict[Any, list[str]] = {}
    said = Agent.objects.filter(connected=True).exclude(gpus=[], problem="")
    for pool, agent, reported, problem in said.values_list("pool_id", "id", "gpus", "problem"):
        for entry in reported or []:
            counts = gpus.setdefault(pool, {}).setdefault((entry["class"], entry["resource"]), [0, 0])
            counts[0] += int(entry["allocatable"])
            counts[1] += int(entry["allocated"])
        if problem:
            problems.setdefault(pool, []).append(f"{agent}: {problem}")
    for pool in set(gpus) | set(problems):
        classes = tuple(
            {"class": name, "resource": resource, "allocatable": counts[0], "allocated": counts[1]}
            for (name, resource), counts in sorted(gpus.get(pool, {}).items())
        )
        found[pool] = replace(found[pool], gpus=classes, problems=tuple(sorted(problems.get(pool, []))))
    return found


# The pool's task (locked), or one queued again whose run was there; and one of that task's runs (locked),
# read only as a run of that task in that pool. Each agent message asks for both: written once, and sent as
# one message where both are wanted. The runs are asked with EXISTS, not joined, so the task row locked is
# the task's alone and no join can repeat it.
_MINE = (
    "(t.pool_id = %s OR (t.pool_id IS NULL AND EXISTS "
    "(SELECT 1 FROM {run} x WHERE x.task_id = t.id AND x.pool_id = %s)))"
)


@functools.cache
def _task_sql(many: bool = False) -> str:
    """The pool's task of an id, locked; or (`many`) those of an array of ids, locked in id order."""
    task, run = Task._meta.db_table, TaskRun._meta.db_table
    mine = _MINE.format(run=run)
    match, order = ("ANY(%s::uuid[])", " ORDER BY t.id") if many else ("%s", "")
    return (
        f"SELECT {rows.columns(Task, 't')} FROM {task} t "  # noqa: S608 -- the models' own tables
        f"WHERE t.id = {match} AND {mine}{order} FOR UPDATE OF t"
    )


@functools.cache
def _run_sql(many: bool = False) -> str:
    """The run of a lease and task under the pool's rule, locked; or (`many`) those of arrays of leases and
    tasks, locked in lease order."""
    task, run = Task._meta.db_table, TaskRun._meta.db_table
    mine = _MINE.format(run=run)
    match, order = ("ANY(%s::uuid[])", " ORDER BY r.lease_id") if many else ("%s", "")
    return (
        f"SELECT {rows.columns(TaskRun, 'r')} FROM {run} r JOIN {task} t ON t.id = r.task_id "  # noqa: S608 -- the models' own tables
        f"WHERE r.lease_id = {match} AND r.task_id = {match} AND {mine}{order} FOR UPDATE OF r"
    )


def pool_task(task_id: str, pool: Pool) -> Task | None:
    """The task with this id in this pool, locked; None for another pool's task or a malformed id. A task
    waiting in the queue again (its pool cleared) counts as the pool's if one of its runs was there."""
    return pool_task_and_run(task_id, "", pool)[0]


def pool_task_and_run(task_id: str, lease_id: str, pool: Pool) -> tuple[Task | None, TaskRun | None]:
    """pool_task(task_id, pool) and run_of(that task, lease_id), both locked, in one round trip (call in a
    transaction); no run where `lease_id` is not one. Within `burst_read`, a task's first lookup takes
    what the block read."""
    identifier, lease = as_uuid(task_id), as_uuid(lease_id)
    if identifier is None:
        return None, None
    burst = _burst.get()
    if burst is not None and burst.pool_id == pool.pk and identifier in burst.tasks:
        task = burst.tasks.pop(identifier)  # taken, with its runs: handed back only as current
        taken = {key: run for key, run in burst.runs.items() if run.task_id == identifier}
        for key in taken:
            del burst.runs[key]
        if lease is None:
            return task, None
        if lease in taken:
            return task, taken[lease]
        # A run the block did not read as this task's: read both, under the pool's rule.
    with connection.cursor() as cursor:
        if lease is None:
            cursor.execute(_task_sql(), [identifier, pool.pk, pool.pk])
            task_row, run_row = cursor.fetchone(), None
        else:
            cursor.execute(
                f"{_task_sql()}; {_run_sql()}",
                [identifier, pool.pk, pool.pk, lease, identifier, pool.pk, pool.pk],
            )
            task_row = cursor.fetchone()
            run_row = cursor.fetchone() if cursor.nextset() else None
    if task_row is None:
        return None, None
    return rows.build(Task, task_row), rows.build(TaskRun, run_row) if run_row is not None else None


@dataclass
class _Burst:
    pool_id: Any
    tasks: dict[uuid.UUID, Task]
    runs: dict[uuid.UUID, TaskRun]
    asked: set[tuple[uuid.UUID, uuid.UUID, int]] = field(default_factory=set)  # (task, lease, seq) read
    kept: set[tuple[uuid.UUID, uuid.UUID, int]] = field(
        default_factory=set
    )  # of those, the agent's reports kept
    keys: list[int] = field(default_factory=list)  # report ids taken for the burst, in order


_burst: ContextVar[_Burst | None] = ContextVar("klique_burst_read", default=None)


@contextmanager
def burst_read(
    named: list[tuple[str, str]], pool: Pool, reports: Sequence[tuple[str, str, int]] = ()
) -> Iterator[None]:
    """The pool's tasks and runs that a burst of an agent's messages names ((task id, lease id) each),
    read and locked, in order of their ids, in one round trip as the block opens (in the burst's
    transaction) rather than one per message. In the block, each task's first `pool_task_and_run` takes
    its row and its run from what was read: nothing in the burst has touched them before. A later lookup
    of the same task reads it again, as the message before may have changed it, unless that message
    handed them back as current (`burst_current`). Within a block already open, it is that block's.

    `reports` ((task id, lease id, seq) of each report of the burst): in the same round trip, which of
    them the task's runs have kept already, and as many report ids; `burst_report_new` answers from
    them for a task the block read (and locked: no one else keeps its agent's reports meanwhile)."""
    if _burst.get() is not None:
        yield
        return
    tasks = sorted({found for found in (as_uuid(task_id) for task_id, _ in named) if found is not None})
    leases = sorted({found for found in (as_uuid(lease_id) for _, lease_id in named) if found is not None})
    if not tasks:
        yield
        return
    asked = _reports_asked(reports)
    statements = [_task_sql(many=True), _run_sql(many=True)]
    params: list[Any] = [tasks, pool.pk, pool.pk, leases, tasks, pool.pk, pool.pk]
    if asked:
        statements += [_kept_sql(), _keys_sql()]
        params += [
            [t for t, _, _ in asked],
            [lease for _, lease, _ in asked],
            [s for _, _, s in asked],
            len(asked),
        ]
    with connection.cursor() as cursor:
        cursor.execute("; ".join(statements), params)
        task_rows = cursor.fetchall()
        run_rows = cursor.fetchall() if cursor.nextset() else []
        kept_rows = cursor.fetchall() if asked and cursor.nextset() else []
        key_rows = cursor.fetchall() if asked and cursor.nextset() else []
    read = _Burst(
        pool_id=pool.pk,
        tasks={task.pk: task for task in (rows.build(Task, row) for row in task_rows)},
        runs={run.pk: run for run in (rows.build(TaskRun, row) for row in run_rows)},
        kept={(task, lease, seq) for task, lease, seq in kept_rows},
        keys=[key for (key,) in key_rows],
    )
    read.asked = {report for report in asked if report[0] in read.tasks}
    opened = _burst.set(read)
    try:
        yield
    finally:
        _burst.reset(opened)


def _reports_asked(reports: Sequence[tuple[str, str, int]]) -> list[tuple[uuid.UUID, uuid.UUID, int]]:
    asked = {(as_uuid(task_id), as_uuid(lease_id), seq) for task_id, lease_id, seq in reports}
    return sorted((task, lease, seq) for task, lease, seq in asked if task is not None and lease is not None)


@functools.cache
def _kept_sql() -> str:
    """Which of arrays of (task, lease, seq) the agent's reports hold."""
    report = TaskReport._meta.db_table
    return (
        f"SELECT k.task_id, k.lease_id, k.seq FROM {report} k "  # noqa: S608 -- the model's own table
        "JOIN unnest(%s::uuid[], %s::uuid[], %s::int[]) AS a(task_id, lease_id, seq) "
        "ON k.task_id = a.task_id AND k.lease_id = a.lease_id AND k.seq = a.seq WHERE k.source = 'agent'"
    )


@functools.cache
def _keys_sql() -> str:
    """So many new report ids, in order."""
    report = TaskReport._meta.db_table
    return f"SELECT nextval(pg_get_serial_sequence('{report}', 'id')) FROM generate_series(1, %s) ORDER BY 1"  # noqa: S608 -- the model's own table


def burst_report_new(task_id: uuid.UUID, lease_id: uuid.UUID | None, seq: int) -> int | None:
    """Within `burst_read`: the id for the agent's report (task, lease, seq) if it is new, taken as it is
    kept (the caller inserts it, with that id, in this transaction); 0 if the run has it already; None where
    the block cannot tell (a task it did not read, a report it was not told of): ask the database."""
    burst = _burst.get()
    if burst is None or lease_id is None:
        return None
    report = (task_id, lease_id, seq)
    if report not in burst.asked or not burst.keys:
        return None
    if report in burst.kept:
        return 0
    burst.kept.add(report)
    return burst.keys.pop(0)


def burst_current(task: Task, run: TaskRun, pool: Pool) -> None:
    """Within `burst_read`: the caller's `task` and `run` are their rows as they now stand (every change
    this transaction made to them was made to these instances too, and they are still locked), so the
    task's next lookup in the burst takes them rather than reading them again. A task no longer the
    pool's (queued again) is read again, under the pool's rule."""
    burst = _burst.get()
    if burst is not None and burst.pool_id == pool.pk and task.pool_id == pool.pk and run.task_id == task.pk:
        burst.tasks[task.pk] = task
        burst.runs[run.pk] = run


def run_of(task: Task | None, lease_id: str) -> TaskRun | None:
    lease = as_uuid(lease_id)
    if task is None or lease is None:
        return None
    return TaskRun.objects.select_for_update().filter(pk=lease, task=task).first()


def task_outputs(task: Task) -> Any:
    """The outputs of the task's latest run (those kept before runs had their own sets, too)."""
    return task.outputs.filter(Q(lease_id=task.lease_id) | Q(lease_id__isnull=True))


def task_output(task: Task, name: str) -> Any:
    """One output of the task's latest run, by name (the newest, if kept twice), or None."""
    return task_outputs(task).filter(name=name).order_by("-at").first()


def task_metrics(task: Task, *, after: int = 0) -> list[dict[str, Any]]:
    """The metrics the task's nodes reported (the task's own values and GPU samples), in order."""
    return [
        {"cursor": cursor, "source": source, "at": at, "values": body.get("values", {})}
        for cursor, source, at, body in task.reports.filter(kind=TaskReport.Kind.METRIC, pk__gt=after)
        .order_by("pk")
        .values_list("pk", "source", "at", "body")
    ]


def task_logs(task: Task, *, after: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "cursor": cursor,
            "seq": seq,
            "source": source,
            "at": at,
            "stream": body.get("stream", "stdout"),
            "lines": body.get("lines", []),
        }
        for cursor, seq, source, at, body in task.reports.filter(kind=TaskReport.Kind.LOG, pk__gt=after)
        .order_by("pk")
        .values_list("pk", "seq", "source", "at", "body")
    ]


def task_log_tail(task: Task, *, after: int = 0, lines: int = 100) -> tuple[list[tuple[str, str]], int, bool]:
    """The latest `lines` lines the task logged after cursor `after`, oldest first, each with its stream;
    the cursor of the newest (to read on from); and whether earlier lines after `after` were left out.
    Reads the newest reports first and stops when it has enough, however long the log."""
    reports = task.reports.filter(kind=TaskReport.Kind.LOG, pk__gt=after).order_by("-pk")
    newest_first: list[list[tuple[str, str]]] = []
    cursor, kept, more, before = after, 0, False, None
    while kept < lines and not more:
        batch = reports.filter(pk__lt=before) if before is not None else reports
        rows = list(batch.values_list("pk", "body")[:200])
        if not rows:
            break
        for pk, body in rows:
            cursor = max(cursor, pk)
            if kept >= lines:
                more = True
                break
            said = body.get("lines", [])
            taken = said[-(lines - kept) :]
            more = more or len(taken) < len(said)
            newest_first.append([(body.get("stream", "stdout"), line) for line in taken])
            kept += len(taken)
        before = rows[-1][0]
    if not more and kept >= lines and before is not None:
        more = reports.filter(pk__lt=before).exists()
    return [line for chunk in reversed(newest_first) for line in chunk], cursor, more


class _Agents:
    """Scheduling's view of the agents (apps.scheduling.agents), answered from the registry here."""

    def connected(self) -> Any:
        return Agent.objects.filter(connected=True).values("pk")

    def silent(self, now: datetime) -> Any:
        timeout = ExpressionWrapper(
            F("pool__heartbeat_timeout_seconds") * timedelta(seconds=1), DurationField()
        )
        return (
            Agent.objects.alias(deadline=now - timeout)
            .filter(last_heartbeat_at__lt=F("deadline"))
            .values("pk")
        )

    def refusing(self) -> dict[str, str]:
        rows = (
            Agent.objects.filter(
                connected=True, pool__environment__in=SCALES_FROM_ZERO, token__instance_of__isnull=True
            )
            .exclude(problem="")
            .values_list("pool_id", "problem")
        )
        return {str(pool): problem for pool, problem in rows}


AGENTS = _Agents()


def cloud_instances(*, live: bool = True, pool: Any = None) -> Any:
    """The cloud pools' instances, newest first: those not ended (live), or all."""
    instances = CloudInstance.objects.select_related("pool").order_by("-launched_at")
    if live:
        instances = instances.filter(ended_at=None)
    if pool is not None:
        instances = instances.filter(pool=pool)
    return instances
