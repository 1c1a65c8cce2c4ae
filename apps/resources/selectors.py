"""Rules read off the configuration: where a project limited to regions may run (data residency)."""

from __future__ import annotations

from typing import Any


def outside(pools: list[dict[str, Any]], regions: list[str]) -> list[dict[str, Any]]:
    """The pools that are not in one of `regions` (a pool with no region is in none); none for no limit."""
    return [pool for pool in pools if regions and pool.get("region", "") not in regions]


def residency_problem(project: str, regions: list[str], resource: str, pools: list[dict[str, Any]]) -> str:
    """Why a project limited to `regions` may not run on a compute resource with these pools, or ""."""
    away = outside(pools, regions)
    if not away:
        return ""
    where = ", ".join(
        f"pool {pool['name']} in " + (f"region {pool['region']}" if pool.get("region") else "no region")
        for pool in away
    )
    return (
        f"Project {project} keeps its work in {', '.join(regions)}, and compute resource {resource} may run "
        f"it in {where}. Give the project a compute resource whose pools are all in {', '.join(regions)}."
    )
