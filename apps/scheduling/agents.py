"""What scheduling needs to know of the agents, which apps.fleet keeps: which are connected, and which
have gone silent. Fleet, which calls down into the lifecycle, answers through this port (it registers
itself when it loads, in apps.fleet.apps), so scheduling never imports fleet back."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol


class Agents(Protocol):
    def connected(self) -> Any:
        """The ids of the connected agents, as a queryset of `pk` values (to filter TaskRun.agent_id by)."""

    def silent(self, now: datetime) -> Any:
        """The ids (a queryset of `pk` values) of the agents whose last heartbeat is older than their
        pool's timeout (their pool may be online still, through another agent)."""

    def refusing(self) -> dict[str, str]:
        """Pools (by id) whose autoscaler cannot start instances now, with its words why: no new work is
        placed there meanwhile."""


_agents: Agents | None = None


def register(agents: Agents) -> None:
    global _agents  # noqa: PLW0603 -- set once per process, when apps.fleet is ready
    _agents = agents


def agents() -> Agents:
    if _agents is None:
        raise RuntimeError("No agents registry: apps.fleet must be in INSTALLED_APPS.")
    return _agents
