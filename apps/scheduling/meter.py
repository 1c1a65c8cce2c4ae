"""Which GPU segments of a task's runs are due, sent to the ledger (apps.metering.runs) by ids.

A run is metered hour by hour while it runs (`meter_running`, from Celery beat) and the rest when it
ends (`meter_run`, called by the lifecycle in the transaction that ends it); a preempted run's next run
starts segments of its own. `Task.metered_until` says how far a run is in the ledger. Runs that end
together (an agent's burst of results, a cycle's preemptions) keep their segments for one write at the
end of their block (`segments_together`), in the same transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.db import OperationalError, connection, transaction
from django.db.models.functions import Coalesce
from django.utils import timezone

from apps.metering.runs import Segment, run_segments
from apps.resources.models import ComputeResource
from apps.scheduling.models import Task, TaskState

logger = logging.getLogger(__name__)

ONE_HOUR, ONE_MS = timedelta(hours=1), timedelta(milliseconds=1)  # running runs are metered by the hour
METER_LOCK_TIMEOUT = "500ms"  # how long an hourly metering pass waits for a lock before moving on


_kept: ContextVar[list[tuple[Segment, Any]] | None] = ContextVar("klique_segments_kept", default=None)


def meter_segment(task: Task, *, started_at: datetime, ended_at: datetime) -> None:
    """One segment of the task's run in the task's pool (the caller sets `task.pool` to the run's): sent to
    the ledger now, or kept for the end of the block of `segments_together` this runs in."""
    segment = Segment(
        task_id=str(task.pk),
        started_at=started_at,
        ended_at=ended_at,
        user_id=str(task.submitter_id),
        project_id=str(task.project_id) if task.project_id else "",
        group="",  # its compute resource's group, read when the segment is sent
        pool_id=str(task.pool_id) if task.pool_id else "",
        compute_resource=task.compute_resource_name,
        units=task.size_units,
    )
    kept = _kept.get()
    if kept is None:
        _send([(segment, task.compute_resource_id)])
    else:
        kept.append((segment, task.compute_resource_id))


@contextmanager
def segments_together() -> Iterator[None]:
    """The segments of runs that end within the block are sent to the ledger together when it ends (one
    write for a burst of runs that ended, not one per run), in the transaction the block runs in: open it
    inside the transaction that ends the runs, and let it end before that transaction commits. A block
    left by an exception sends nothing, as the transaction it runs in is undone; within a block already
    open, it is that block's."""
    if _kept.get() is not None:
        yield
        return
    kept: list[tuple[Segment, Any]] = []
    opened = _kept.set(kept)
    try:
        yield
    finally:
        _kept.reset(opened)
    if kept:
        _send(kept)


def _send(segments: list[tuple[Segment, Any]]) -> None:
    """Segments, each with its task's compute resource (an id, or None), to the ledger with the group of
    that resource's policy: one read for them all, not the resource, its policy and its group in turn."""
    resources = {resource for _, resource in segments if resource is not None}
    groups = (
        dict(ComputeResource.objects.filter(pk__in=resources).values_list("pk", "policy__group__name"))
        if resources
        else {}
    )
    run_segments([replace(segment, group=groups.get(resource) or "") for segment, resource in segments])


def meter_run(task: Task, *, ended_at: datetime, current: bool = False) -> None:
    """What the run that ends now has not yet metered (all of it, or since the last whole hour that
    meter_running wrote) goes to the ledger as a GPU segment (data flow, step 5). Every way a run ends
    calls this in the transaction that ends it: the lifecycle's `transition` and `tasks_preempt`.
    `current`: the caller read `task` with its row locked in this transaction, so its `metered_until` is
    the row's."""
    # The row lock orders this after a meter_running pass on the same run. No savepoint: a run ends inside
    # its caller's transaction, whose failure undoes this too.
    with transaction.atomic(savepoint=False):
        metered = (
            task.metered_until
            if current
            else Task.objects.select_for_update()
            .filter(pk=task.pk)
            .values_list("metered_until", flat=True)
            .first()
        )
        start = unmetered_from(task.started_at or ended_at, metered)
        meter_segment(task, started_at=start, ended_at=ended_at)
        task.metered_until = ended_at  # so that the caller's save() keeps the row's value current


def meter_running(*, now: datetime | None = None) -> int:
    """Meter each running run hour by hour up to the last whole hour: a long run's GPU time reaches the
    ledger, the hourly rollups and its wallet while it runs, not all at once when it stops. Each hour's
    segment ends at that hour's last millisecond, so that it counts in the hour it covers (the rollups
    count an event in the hour it ended); the next segment starts there. Returns how many segments were
    written. Celery beat runs it every few minutes; a pass that finds nothing new writes nothing.

    It gives way to the paths that end runs: a run whose row or ledger rows another transaction holds for
    over METER_LOCK_TIMEOUT is left to the next pass (or to its stop), rather than waiting behind a
    scheduling cycle or deadlocking with one."""
    last = (now or timezone.now()).replace(minute=0, second=0, microsecond=0) - ONE_MS
    due = Task.objects.alias(metered=Coalesce("metered_until", "started_at")).filter(
        state=TaskState.RUNNING, metered__lt=last
    )  # a run metered to the end of the last hour has nothing due until the next one ends
    written = 0
    for pk in due.order_by().values_list("pk", flat=True):
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(f"SET LOCAL lock_timeout = '{METER_LOCK_TIMEOUT}'")
                written += _meter_hours(pk, last)
        except OperationalError as error:  # a lock not granted in time, or a deadlock PostgreSQL broke
            logger.warning("run of task %s left to the next metering pass: %s", pk, error)
    return written


def _meter_hours(pk: Any, last: datetime) -> int:
    """Write the whole hours of one running run up to `last`; how many segments."""
    task = Task.objects.select_for_update(of=("self",)).filter(pk=pk, state=TaskState.RUNNING).first()
    if task is None or task.started_at is None:
        return 0  # it stopped meanwhile, and its stop metered it
    start = unmetered_from(task.started_at, task.metered_until)
    end = start.replace(minute=0, second=0, microsecond=0) + ONE_HOUR - ONE_MS
    end = end if end > start else end + ONE_HOUR
    written = 0
    while end <= last:
        meter_segment(task, started_at=start, ended_at=end)
        start, end, written = end, end + ONE_HOUR, written + 1
    Task.objects.filter(pk=pk).update(metered_until=start)
    return written


def unmetered_from(started_at: datetime, metered_until: datetime | None) -> datetime:
    """Where the part of a run not yet in the ledger starts: its start, or where the hourly passes left it."""
    return max(started_at, metered_until) if metered_until else started_at
