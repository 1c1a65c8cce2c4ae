"""The agent protocol's messages as typed structures, with the one parser both sides validate with.

The plane parses what agents send with `parse_from_agent`, and the agent parses what the plane sends
with `parse_from_plane`; each returns one of the classes below or raises ProtocolError with a sentence
that names the field. `as_json()` gives the wire form (a JSON object with a "type").

Leases are the fencing tokens: every assignment names its task's lease and attempt, and every report,
acknowledgement, stop and held run names the lease it belongs to. The plane applies a report only to the
lease it names and answers each one with a verdict (applied, duplicate, stale), so an agent's outbox
always empties: a stale report is dropped, never sent again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

PROTOCOL = 2  # hello says which version the agent speaks; the plane refuses an older one with what to do

REPORT_KINDS = ("status", "log", "metric", "result")
MAX_RESULT_REASON = 500
APPLIED, DUPLICATE, STALE = "applied", "duplicate", "stale"
VERDICTS = (APPLIED, DUPLICATE, STALE)
STOP_KINDS = ("abort", "preempt")
MAX_ID = 100  # characters of an id: task, lease, agent
MAX_SEQ = 2**31 - 1
MAX_HELD = 10_000  # runs one agent may say it holds
MAX_TEXT = 2_000
MAX_PROBLEM = 500

Verdict = Literal["applied", "duplicate", "stale"]


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text says which field and what it should be."""


# Reading fields ----------------------------------------------------------------------------------------


def _text(content: Mapping[str, Any], key: str, *, required: bool = True, limit: int = MAX_ID) -> str:
    value = content.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise ProtocolError(f"{key} must be a non-empty string.")
    return _bounded(key, value, limit)


def _lease(content: Mapping[str, Any]) -> str:
    """A lease id: "" only for a run its agent started before it spoke of leases (the plane maps it)."""
    value = content.get("lease_id")
    if not isinstance(value, str):
        raise ProtocolError("lease_id must be a string: the lease the run was handed out under.")
    return _bounded("lease_id", value, MAX_ID)


def _bounded(key: str, value: str, limit: int) -> str:
    if len(value) > limit or "\x00" in value:
        raise ProtocolError(f"{key} must be at most {limit} characters, without NUL.")
    return value


def _whole(content: Mapping[str, Any], key: str, *, low: int, high: int) -> int:
    value = content.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"{key} must be a whole number from {low} to {high}.")
    return value


def _seconds(content: Mapping[str, Any], key: str, default: float) -> float:
    value = content.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ProtocolError(f"{key} must be a number of seconds.")
    return max(0.0, float(value))


def _mapping(content: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = content.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{key} must be an object.")
    return value


def _problem(content: Mapping[str, Any]) -> str | None:
    """An agent's problem, as text of at most MAX_PROBLEM characters; None where it says none."""
    problem = content.get("problem")
    return problem[:MAX_PROBLEM] if isinstance(problem, str) else None


def _held(content: Mapping[str, Any], key: str) -> tuple[Held, ...]:
    value = content.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_HELD:
        raise ProtocolError(f"{key} must be a list of at most {MAX_HELD} runs.")
    return tuple(Held.parse(item) for item in value)


# Both directions ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Held:
    """A run an agent holds: still running, or ended with reports the plane has not acknowledged. Its
    lease is "" where the agent does not know it (a run started before the agent spoke of leases): the
    plane's welcome names it."""

    task_id: str
    lease_id: str
    ended: bool = False

    @classmethod
    def parse(cls, item: object) -> Held:
        if not isinstance(item, dict):
            raise ProtocolError("Each held run is an object {task_id, lease_id, ended}.")
        return cls(_text(item, "task_id"), _lease(item), item.get("ended") is True)

    def as_json(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "lease_id": self.lease_id, "ended": self.ended}


# Agent -> plane -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    agent_id: str
    backend: str = ""
    version: str = ""
    instance: str = ""  # the agent's instance key, which its token is bound to
    inventory: dict[str, Any] = field(default_factory=dict)
    capacity: dict[str, Any] = field(default_factory=dict)
    held: tuple[Held, ...] = ()
    protocol: int = PROTOCOL
    problem: str = ""  # what stops the agent's environment from taking work, in words, or ""

    def as_json(self) -> dict[str, Any]:
        return {
            "type": "hello",
            "protocol": self.protocol,
            "agent_id": self.agent_id,
            "backend": self.backend,
            "version": self.version,
            "instance": self.instance,
            "inventory": self.inventory,
            "capacity": self.capacity,
            "held": [run.as_json() for run in self.held],
            "problem": self.problem,
        }


@dataclass(frozen=True, slots=True)
class Heartbeat:
    held: tuple[Held, ...] = ()
    queue: list[dict[str, Any]] | None = None  # an HPC agent's view of its cluster's queue
    capacity: dict[str, Any] | None = None
    problem: str | None = None  # as in Hello; None from an agent that does not say

    def as_json(self) -> dict[str, Any]:
        message: dict[str, Any] = {"type": "heartbeat", "held": [run.as_json() for run in self.held]}
        if self.problem is not None:
            message["problem"] = self.problem
        if self.queue is not None:
            message["queue"] = self.queue
        if self.capacity is not None:
            message["capacity"] = self.capacity
        return message


@dataclass(frozen=True, slots=True)
class Accepted:
    task_id: str
    lease_id: str

    def as_json(self) -> dict[str, Any]:
        return {"type": "accepted", "task_id": self.task_id, "lease_id": self.lease_id}


@dataclass(frozen=True, slots=True)
class Rejected:
    task_id: str
    lease_id: str
    reason: str
    permanent: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "type": "rejected",
            "task_id": self.task_id,
            "lease_id": self.lease_id,
            "reason": self.reason,
            "permanent": self.permanent,
        }


@dataclass(frozen=True, slots=True)
class Report:
    """status, log, metric or result of one run, numbered per lease."""

    kind: str
    task_id: str
    lease_id: str
    seq: int
    body: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {**self.body, "type": self.kind, "task_id": self.task_id, "lease_id": self.lease_id,
                "seq": self.seq}  # fmt: skip


def _report(kind: str, content: Mapping[str, Any]) -> Report:
    task_id, lease_id = _text(content, "task_id"), _lease(content)
    seq = _whole(content, "seq", low=1, high=MAX_SEQ)
    body = {key: value for key, value in content.items() if key not in ("type", "task_id", "lease_id", "seq")}
    if kind == "log":
        lines = body.get("lines", [])
        if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
            raise ProtocolError("A log report's lines must be a list of strings.")
    if kind == "result":
        code = body.get("exit_code")
        if code is not None and (not isinstance(code, int) or isinstance(code, bool)):
            raise ProtocolError("A result's exit_code must be a whole number or null.")
        reason = body.get("reason", "")
        if not isinstance(reason, str) or len(reason) > MAX_RESULT_REASON:
            raise ProtocolError(
                f"A result's reason is text of at most {MAX_RESULT_REASON} characters: why the run failed "
                "outside its own command (an image missing, a program that could not start)."
            )
    if kind == "status" and not isinstance(body.get("state"), str):
        raise ProtocolError("A status report names its state.")
    return Report(kind, task_id, lease_id, seq, body)


def parse_from_agent(content: object) -> Hello | Heartbeat | Accepted | Rejected | Report:
    """One message an agent sent, checked; ProtocolError says what is wrong."""
    if not isinstance(content, dict):
        raise ProtocolError("Each message is a JSON object with a type.")
    kind = content.get("type")
    if kind == "hello":
        protocol = content.get("protocol", 1)
        if protocol != PROTOCOL:
            raise ProtocolError(
                f"This control plane speaks agent protocol {PROTOCOL} and the agent speaks {protocol!r}: "
                "install the klique-agent of the control plane's version."
            )
        return Hello(
            agent_id=_text(content, "agent_id"),
            backend=_text(content, "backend", required=False, limit=30),
            version=_text(content, "version", required=False, limit=30),
            instance=_text(content, "instance", required=False, limit=200),
            inventory=_mapping(content, "inventory"),
            capacity=_mapping(content, "capacity"),
            held=_held(content, "held"),
            problem=_problem(content) or "",
        )
    if kind == "heartbeat":
        queue = content.get("queue")
        capacity = content.get("capacity")
        return Heartbeat(
            held=_held(content, "held"),
            queue=queue if isinstance(queue, list) else None,
            capacity=capacity if isinstance(capacity, dict) else None,
            problem=_problem(content),
        )
    if kind == "accepted":
        return Accepted(_text(content, "task_id"), _text(content, "lease_id"))
    if kind == "rejected":
        reason = content.get("reason")
        return Rejected(
            _text(content, "task_id"),
            _text(content, "lease_id"),
            reason[:MAX_TEXT] if isinstance(reason, str) and reason else "no reason given",
            content.get("permanent") is True,
        )
    if kind in REPORT_KINDS:
        return _report(kind, content)
    raise ProtocolError(f"Unknown message type {kind!r}.")


# Plane -> agent -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop one run: abort at once, or preempt after a grace period for a checkpoint."""

    kind: str
    task_id: str
    lease_id: str
    grace_seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"type": self.kind, "task_id": self.task_id, "lease_id": self.lease_id,
                "grace_seconds": self.grace_seconds}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Welcome:
    heartbeat_seconds: float
    lease_seconds: float
    keep: tuple[Held, ...] = ()  # runs the plane agrees the agent has
    stop: tuple[Stop, ...] = ()  # runs the agent should stop: not the plane's, or aborted meanwhile

    def as_json(self) -> dict[str, Any]:
        return {
            "type": "welcome",
            "protocol": PROTOCOL,
            "heartbeat_seconds": self.heartbeat_seconds,
            "lease_seconds": self.lease_seconds,
            "keep": [run.as_json() for run in self.keep],
            "stop": [stop.as_json() for stop in self.stop],
        }


@dataclass(frozen=True, slots=True)
class Assign:
    """A run handed to the agent under a lease; `details` holds the rest (spec, size, user, secrets)."""

    task_id: str
    lease_id: str
    attempt: int
    details: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {**self.details, "type": "assign", "task_id": self.task_id, "lease_id": self.lease_id,
                "attempt": self.attempt}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Ack:
    """The plane's verdict on one report: applied, a duplicate of one applied before, or stale (its lease
    is not the task's run any more). Each verdict lets the agent drop the report."""

    task_id: str
    lease_id: str
    seq: int
    verdict: str = APPLIED
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        message = {"type": "ack", "task_id": self.task_id, "lease_id": self.lease_id, "seq": self.seq,
                   "verdict": self.verdict}  # fmt: skip
        if self.detail:
            message["detail"] = self.detail
        return message


@dataclass(frozen=True, slots=True)
class Error:
    detail: str
    about: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"type": "error", "detail": self.detail, "about": self.about}


def parse_from_plane(content: object) -> Welcome | Assign | Ack | Stop | Error:
    """One message the plane sent, checked; ProtocolError says what is wrong."""
    if not isinstance(content, dict):
        raise ProtocolError("Each message is a JSON object with a type.")
    kind = content.get("type")
    if kind == "welcome":
        stops = content.get("stop") or []
        if not isinstance(stops, list):
            raise ProtocolError("welcome.stop must be a list.")
        return Welcome(
            _seconds(content, "heartbeat_seconds", 10.0),
            _seconds(content, "lease_seconds", 30.0),
            _held(content, "keep"),
            tuple(
                _stop(item.get("type"), item) if isinstance(item, dict) else _stop(None, {}) for item in stops
            ),
        )
    if kind == "assign":
        details = {key: value for key, value in content.items()
                   if key not in ("type", "task_id", "lease_id", "attempt")}  # fmt: skip
        return Assign(
            _text(content, "task_id"),
            _text(content, "lease_id"),
            _whole(content, "attempt", low=1, high=MAX_SEQ),
            details,
        )
    if kind == "ack":
        verdict = content.get("verdict", APPLIED)
        if verdict not in VERDICTS:
            raise ProtocolError(f"ack.verdict must be one of {', '.join(VERDICTS)}.")
        detail = content.get("detail")
        return Ack(
            _text(content, "task_id"),
            _lease(content),
            _whole(content, "seq", low=1, high=MAX_SEQ),
            verdict,
            detail if isinstance(detail, str) else "",
        )
    if kind in STOP_KINDS:
        return _stop(kind, content)
    if kind == "error":
        detail, about = content.get("detail"), content.get("about")
        return Error(
            str(detail)[:MAX_TEXT] if detail else "no detail", about if isinstance(about, str) else ""
        )
    raise ProtocolError(f"Unknown message type {kind!r}.")


def _stop(kind: object, content: Mapping[str, Any]) -> Stop:
    if kind not in STOP_KINDS:
        raise ProtocolError("A stop is an abort or a preempt.")
    assert isinstance(kind, str)
    return Stop(kind, _text(content, "task_id"), _lease(content), _seconds(content, "grace_seconds", 0.0))
