"""What a cloud pool's autoscaler and the plane say to each other over HTTPS, beside the agent websocket.

The autoscaler (`klique-agent --backend cloud`) is its pool's listener: an ordinary agent on the websocket
that accepts the pool's assignments under their leases. Capacity it starts comes and goes, so three more
calls carry what only it knows, each authenticated with its own agent token and checked by these types on
both sides:

    POST /agents/v1/cloud/instances/<name>/token/   mint a short-lived, pool-scoped token for a new
                                                    instance's agent (its first hello must come before
                                                    expires_at; it dies when the instance ends)
    POST /agents/v1/cloud/handoff/                  Handoff: the run under this lease ends, handed on,
                                                    and the task goes on in a new run, under a new lease,
                                                    on that instance's agent, which must accept it within
                                                    patience_seconds or the task is queued again
    POST /agents/v1/cloud/instances/                InstancesReport of every instance it knows, answered
                                                    with the FleetView: which instance agents are
                                                    connected and which runs each holds, as of the plane's
                                                    clock

A handoff is fenced by its lease like every report: only the autoscaler holding the run's current lease
may hand it on, and only to an instance of its own pool that has not ended.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol.messages import MAX_ID, ProtocolError

# An instance's name is its agent's id: lowercase letters, digits and dashes, starting with a letter or digit.
INSTANCE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")

# Where an instance is in its life, as its autoscaler says:
LAUNCHING = "launching"  # asked of the provider, nothing seen yet
BOOTING = "booting"  # the provider runs it; its agent has not said hello
BUSY = "busy"  # its agent is connected and holds work
IDLE = "idle"  # its agent is connected and holds nothing
STOPPING = "stopping"  # the autoscaler asked the provider to end it
STOPPED = "stopped"  # ended by the autoscaler (idle past its timeout, never booted, scaled in)
INTERRUPTED = "interrupted"  # ended or about to be ended by the cloud (spot reclaimed, vanished)
FAILED = "failed"  # the provider refused to start it
STATES = (LAUNCHING, BOOTING, BUSY, IDLE, STOPPING, STOPPED, INTERRUPTED, FAILED)
ENDED = frozenset({STOPPED, INTERRUPTED, FAILED})
BILLED = frozenset({BOOTING, BUSY, IDLE, STOPPING})  # the provider charges for these
MAX_INSTANCES = 10_000
MAX_PATIENCE_SECONDS = 3600.0
MAX_REASON = 500


def _name(content: Mapping[str, Any], key: str) -> str:
    value = content.get(key)
    if not isinstance(value, str) or not INSTANCE_NAME.match(value):
        raise ProtocolError(f"{key} must be an instance name: lowercase letters, digits and dashes, 1 to 63.")
    return value


def _text(content: Mapping[str, Any], key: str, limit: int = MAX_ID) -> str:
    value = content.get(key, "")
    if not isinstance(value, str) or len(value) > limit or "\x00" in value:
        raise ProtocolError(f"{key} must be a string of at most {limit} characters.")
    return value


def _count(content: Mapping[str, Any], key: str, high: int) -> int:
    value = content.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
        raise ProtocolError(f"{key} must be a whole number from 0 to {high}.")
    return value


def _number(content: Mapping[str, Any], key: str, low: float, high: float) -> float:
    value = content.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ProtocolError(f"{key} must be a number.")
    if not low <= value <= high:
        raise ProtocolError(f"{key} must be from {low:g} to {high:g}.")
    return float(value)


@dataclass(frozen=True, slots=True)
class Instance:
    """One instance as its autoscaler sees it."""

    name: str
    state: str
    instance_type: str = ""
    provider_id: str = ""  # the provider's own id (i-0abc...), "" before it has one
    gpus: int = 0
    spot: bool = False
    region: str = ""
    reason: str = ""  # why it is in this state, in words (an interruption notice, a refusal)

    @classmethod
    def parse(cls, item: object) -> Instance:
        if not isinstance(item, dict):
            raise ProtocolError("Each instance is an object {name, state, instance_type, ...}.")
        state = item.get("state")
        if state not in STATES:
            raise ProtocolError(f"state must be one of {', '.join(STATES)}.")
        return cls(
            name=_name(item, "name"),
            state=str(state),
            instance_type=_text(item, "instance_type"),
            provider_id=_text(item, "provider_id"),
            gpus=_count(item, "gpus", 1024),
            spot=item.get("spot") is True,
            region=_text(item, "region"),
            reason=_text(item, "reason", MAX_REASON),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "instance_type": self.instance_type,
            "provider_id": self.provider_id,
            "gpus": self.gpus,
            "spot": self.spot,
            "region": self.region,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class InstancesReport:
    instances: tuple[Instance, ...]

    @classmethod
    def parse(cls, content: object) -> InstancesReport:
        listed = content.get("instances") if isinstance(content, dict) else None
        if not isinstance(listed, list) or len(listed) > MAX_INSTANCES:
            raise ProtocolError(f'Send {{"instances": [...]}} with at most {MAX_INSTANCES} instances.')
        instances = tuple(Instance.parse(item) for item in listed)
        if len({instance.name for instance in instances}) != len(instances):
            raise ProtocolError("Each instance is reported once.")
        return cls(instances)

    def as_json(self) -> dict[str, Any]:
        return {"instances": [instance.as_json() for instance in self.instances]}


@dataclass(frozen=True, slots=True)
class FleetRun:
    """A run on an instance's agent: handed to it and not yet ended."""

    task_id: str
    lease_id: str
    units: int  # the GPUs it holds, in 1/840 GPU

    @classmethod
    def parse(cls, item: object) -> FleetRun:
        if not isinstance(item, dict):
            raise ProtocolError("Each run is an object {task_id, lease_id, units}.")
        return cls(_text(item, "task_id"), _text(item, "lease_id"), _count(item, "units", 2**31 - 1))

    def as_json(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "lease_id": self.lease_id, "units": self.units}


@dataclass(frozen=True, slots=True)
class FleetAgent:
    """An instance's agent as the plane sees it: connected or not, and the runs that are on it."""

    agent_id: str
    connected: bool
    runs: tuple[FleetRun, ...] = ()

    @classmethod
    def parse(cls, item: object) -> FleetAgent:
        if not isinstance(item, dict):
            raise ProtocolError("Each agent is an object {agent_id, connected, runs}.")
        runs = item.get("runs", [])
        if not isinstance(runs, list) or len(runs) > MAX_INSTANCES:
            raise ProtocolError("runs must be a list.")
        return cls(
            _name(item, "agent_id"), item.get("connected") is True, tuple(FleetRun.parse(r) for r in runs)
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "agent_id": self.agent_id,
            "connected": self.connected,
            "runs": [run.as_json() for run in self.runs],
        }


@dataclass(frozen=True, slots=True)
class FleetView:
    """The plane's answer to an InstancesReport, as of `as_of` (the plane's clock, seconds since 1970)."""

    as_of: float
    agents: tuple[FleetAgent, ...]

    @classmethod
    def parse(cls, content: object) -> FleetView:
        if not isinstance(content, dict) or not isinstance(content.get("agents"), list):
            raise ProtocolError('A fleet view is {"as_of": seconds, "agents": [...]}.')
        return cls(
            _number(content, "as_of", 0, 1e11), tuple(FleetAgent.parse(item) for item in content["agents"])
        )

    def as_json(self) -> dict[str, Any]:
        return {"as_of": self.as_of, "agents": [agent.as_json() for agent in self.agents]}


@dataclass(frozen=True, slots=True)
class Handoff:
    """The run under `lease_id` goes to the agent of instance `agent_id`."""

    task_id: str
    lease_id: str
    agent_id: str
    patience_seconds: float

    @classmethod
    def parse(cls, content: object) -> Handoff:
        if not isinstance(content, dict):
            raise ProtocolError("A handoff is an object {task_id, lease_id, agent_id, patience_seconds}.")
        task_id, lease_id = _text(content, "task_id"), _text(content, "lease_id")
        if not task_id or not lease_id:
            raise ProtocolError("task_id and lease_id name the run handed on.")
        return cls(
            task_id,
            lease_id,
            _name(content, "agent_id"),
            _number(content, "patience_seconds", 1, MAX_PATIENCE_SECONDS),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "lease_id": self.lease_id,
            "agent_id": self.agent_id,
            "patience_seconds": self.patience_seconds,
        }


@dataclass(frozen=True, slots=True)
class Handed:
    """The plane took the handoff at `at` (its clock): the run goes on under a new lease, `lease_id`, which
    only the instance's agent holds; a FleetView as of later shows it on that agent."""

    lease_id: str
    at: float

    @classmethod
    def parse(cls, content: object) -> Handed:
        if not isinstance(content, dict):
            raise ProtocolError('A handoff answer is {"lease_id": ..., "at": seconds}.')
        lease_id = _text(content, "lease_id")
        if not lease_id:
            raise ProtocolError("lease_id names the run's new lease.")
        return cls(lease_id, _number(content, "at", 0, 1e11))

    def as_json(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "at": self.at}


@dataclass(frozen=True, slots=True)
class Minted:
    """A token for one instance's agent, good for its first hello until `expires_at` (seconds since 1970)."""

    token: str
    expires_at: float

    @classmethod
    def parse(cls, content: object) -> Minted:
        if not isinstance(content, dict):
            raise ProtocolError('A minted token is {"token": ..., "expires_at": seconds}.')
        token = _text(content, "token", 200)
        if not token.startswith("kqa_"):
            raise ProtocolError("token must be an agent token (kqa_...).")
        return cls(token, _number(content, "expires_at", 0, 1e11))

    def as_json(self) -> dict[str, Any]:
        return {"token": self.token, "expires_at": self.expires_at}
