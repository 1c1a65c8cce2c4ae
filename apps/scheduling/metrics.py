"""Queue metrics for Prometheus, read from the database when /metrics is scraped (cached briefly)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from threading import Lock

from django_tenants.utils import schema_context
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from apps.resources.models import ComputeResource
from apps.scheduling import objectives
from apps.scheduling.models import WaitObjective
from apps.scheduling.selectors import queue_depths, queue_wait
from tenants.selectors import tenant_list

CACHE_SECONDS = 15.0


def _families() -> tuple[GaugeMetricFamily, ...]:
    return (
        GaugeMetricFamily(
            "klique_queue_wait_seconds",
            "Queue wait of tasks placed in the last 24 hours, by compute resource.",
            labels=["tenant", "compute_resource", "quantile"],
        ),
        GaugeMetricFamily(
            "klique_group_queue_wait_seconds",
            "Queue wait of tasks placed in the last 24 hours, by group.",
            labels=["tenant", "group", "quantile"],
        ),
        GaugeMetricFamily(
            "klique_queue_tasks",
            "Tasks queued and active, by compute resource.",
            labels=["tenant", "compute_resource", "state"],
        ),
        GaugeMetricFamily(
            "klique_wait_objective_seconds",
            "A queue-wait objective's percentile of waits over its window, and its target.",
            labels=["tenant", "objective", "kind"],
        ),
        GaugeMetricFamily(
            "klique_wait_objective_attainment",
            "The share of an objective's tasks that waited within its target, over its window.",
            labels=["tenant", "objective"],
        ),
        GaugeMetricFamily(
            "klique_wait_objective_error_budget",
            "The share of an objective's error budget left (0: breached).",
            labels=["tenant", "objective"],
        ),
    )


class QueueCollector(Collector):
    """p50/p95 queue wait per compute resource and per group, and queue depth, for every active tenant."""

    def __init__(self) -> None:
        self._lock = Lock()
        self._cached: tuple[float, list[Metric]] = (0.0, [])

    def describe(self) -> Iterator[Metric]:
        # Without describe(), registering the collector would call collect(): a query at start-up.
        yield from _families()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            taken, metrics = self._cached
            if not metrics or time.monotonic() - taken > CACHE_SECONDS:
                metrics = self._read()
                self._cached = (time.monotonic(), metrics)
        yield from metrics

    def _read(self) -> list[Metric]:
        by_resource, by_group, depth, objective_wait, attained, budget = _families()
        for tenant in tenant_list().filter(status="active"):
            with schema_context(tenant.schema_name):
                names = {str(pk): name for pk, name in ComputeResource.objects.values_list("pk", "name")}
                for key, stats in queue_wait(by="compute_resource").items():
                    for quantile, value in (("0.5", stats.p50_seconds), ("0.95", stats.p95_seconds)):
                        if value is not None and key in names:
                            by_resource.add_metric([tenant.slug, names[key], quantile], value)
                for group, stats in queue_wait(by="group").items():
                    for quantile, value in (("0.5", stats.p50_seconds), ("0.95", stats.p95_seconds)):
                        if value is not None:
                            by_group.add_metric([tenant.slug, group, quantile], value)
                for key, counts in queue_depths().items():
                    if key in names:
                        for state, count in counts.items():
                            depth.add_metric([tenant.slug, names[key], state], count)
                _objectives(tenant.slug, objective_wait, attained, budget)
        return [by_resource, by_group, depth, objective_wait, attained, budget]


def _objectives(
    tenant: str, wait: GaugeMetricFamily, attained: GaugeMetricFamily, budget: GaugeMetricFamily
) -> None:
    """Each queue-wait objective of the tenant in use: its value and target, attainment, budget left."""
    for objective in WaitObjective.objects.all():
        current = objectives.status(objective, explain=False)
        wait.add_metric([tenant, objective.name, "target"], objective.target_seconds)
        if current.window.value_seconds is not None:
            wait.add_metric([tenant, objective.name, "value"], current.window.value_seconds)
        if (share := current.window.fraction()) is not None:
            attained.add_metric([tenant, objective.name], share)
        if current.budget_left is not None:
            budget.add_metric([tenant, objective.name], current.budget_left)
