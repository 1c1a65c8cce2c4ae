"""Run metering: the GPU time of a task's run, into the ledger as segments named by ids.

Scheduling says which segments are due (apps.scheduling.meter: the rest of a run when it ends, each whole
hour while it runs) and sends each here by the ids of its task, submitter, project and pool. A segment's
start names it, so writing one twice counts once. What a segment costs goes to the wallets it draws from
through the `cost_recorded` signal.
"""

from __future__ import annotations

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
    """Meter one segment of a task's run: its GPUs from started_at to ended_at, for its submitter and
    project in its pool (all by id), and send what it cost to the wallets it draws from."""
    event = Event(
        event_id=segment_prefix(task_id) + started_at.isoformat(),
        kind=Kind.GPU,
        started_at=started_at,
        ended_at=max(ended_at, started_at),
        user=user_id,
        project=project_id,
        group=group,
        pool=pool_id,
        compute_resource=compute_resource,
        gpus=Fraction(units, UNITS_PER_GPU),
        source="scheduler",
    )
    report = ingest([event], now=max(ended_at, timezone.now()))
    for cost in report.costs():
        cost_recorded.send(
            sender=Event,
            user_id=cost.user_id,
            project_id=cost.project_id,
            cost_nano_usd=cost.cost_nano_usd,
            at=cost.ended_at,
        )
    return report
