"""Reads of the fleet: what agents report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Sum

from apps.fleet.models import Agent


@dataclass(frozen=True)
class Reported:
    """A pool's connected agents (workers) and what they report, summed; a figure no agent reports is
    None, not 0."""

    workers: int = 0
    cpus: int | None = None
    cpus_in_use: int | None = None
    nodes: int | None = None


NONE_REPORTED = Reported()


def agents_by_pool() -> dict[Any, Reported]:
    """Reported, per pool id, for the pools with a connected agent."""
    rows = (
        Agent.objects.filter(connected=True)
        .values("pool_id")
        .annotate(workers=Count("id"), cpus=Sum("cpus"), cpus_in_use=Sum("cpus_in_use"), nodes=Sum("nodes"))
        .values_list("pool_id", "workers", "cpus", "cpus_in_use", "nodes")
    )
    return {pool: Reported(*figures) for pool, *figures in rows}
