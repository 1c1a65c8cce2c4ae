"""Run metering: the GPU time of a task's run, into the ledger as segments named by ids.

Scheduling says which segments are due (apps.scheduling.meter: the rest of a run when it ends, each whole
hour while it runs) and sends each here by the ids of its task, submitter, project and pool. A segment's
start names it, so writing one twice counts once. What a segment costs goes to the wallets it draws from
through the `cost_recorded` signal.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction

from django.utils import timezone

from apps.metering.ledger import Event, Report, ingest
from apps.metering.models import Kind
from apps.metering.signals import cost_recorded
from protocol.units import UNITS_PER_GPU


def segment_prefix(task_id: object) -> str:
    """A task's GPU segments are named gpu:<task id>:<the segment's start>."""
    return f"gpu:{task_id}:"


@dataclass(frozen=True)
class Segment:
    """One segment of a task's run: its GPUs from started_at to ended_at, for its submitter and project in
    its pool (all by id)."""

    task_id: str
    started_at: datetime
    ended_at: datetime
    user_id: str
    project_id: str
    group: str
    pool_id: str
    compute_resource: str
    units: int

    def event(self) -> Event:
        return Event(
            event_id=segment_prefix(self.task_id) + self.started_at.isoformat(),
            kind=Kind.GPU,
            started_at=self.started_at,
            ended_at=max(self.ended_at, self.started_at),
            user=self.user_id,
            project=self.project_id,
            group=self.group,
            pool=self.pool_id,
            compute_resource=self.compute_resource,
            gpus=Fraction(self.units, UNITS_PER_GPU),
            source="scheduler",
        )


def run_segment(
    *,
    task_id: str,
    started_at: datetime,
    ended_at: datetime,
    user_id: str,
    project_id: str,
    group: str,
    pool_id: str,
    compute_resource: str,
    units: int,
) -> Report:
    """Meter one segment of a task's run, and send what it cost to the wallets it draws from."""
    return run_segments(
        [
            Segment(
                task_id=task_id,
                started_at=started_at,
                ended_at=ended_at,
                user_id=user_id,
                project_id=project_id,
                group=group,
                pool_id=pool_id,
                compute_resource=compute_resource,
                units=units,
            )
        ]
    )


def run_segments(segments: list[Segment]) -> Report:
    """Meter segments of runs in one write to the ledger (a burst of runs that ended together), and send
    what each cost to the wallets it draws from."""
    latest = max(segment.ended_at for segment in segments)
    report = ingest([segment.event() for segment in segments], now=max(latest, timezone.now()))
    for cost in report.costs():
        cost_recorded.send(
            sender=Event,
            user_id=cost.user_id,
            project_id=cost.project_id,
            cost_nano_usd=cost.cost_nano_usd,
            at=cost.ended_at,
        )
    return report
