"""What every agent backend offers the agent loop (agents.main): the bare-metal runner and the HPC
submitters (Slurm, PBS, LSF) alike."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from agents.node import free_loopback_port
from agents.state import Position, State

# (task id, kind, body, log offset or pod log cursor reached, or None) -> sent when it may be
Report = Callable[[str, str, dict[str, Any], Position | None], Awaitable[None]]
# (task id, name relative to its folder, file) -> upload it to the plane's file store
Upload = Callable[[str, str, Path], Awaitable[None]]


async def upload_outputs(
    folder: Path, task_id: str, patterns: list[str], upload: Upload | None, report: Report | None
) -> tuple[list[str], list[dict[str, str]]]:
    """Upload the files in the task's folder that match its declared output patterns (each upload retries
    while the plane cannot take it); returns those stored and, for each one that could not be, why. A
    failure is also said in the task's log; the file stays where it is."""
    names = sorted(
        {
            str(path.relative_to(folder))
            for pattern in patterns
            for path in folder.glob(pattern)
            if path.is_file() and path.resolve().is_relative_to(folder.resolve())
        }
    )
    uploaded: list[str] = []
    failed: list[dict[str, str]] = []
    for name in names:
        if upload is None:
            break
        try:
            await upload(task_id, name, folder / name)
            uploaded.append(name)
        except Exception as error:  # the result still goes out, saying what could not be stored
            failed.append({"name": name, "error": str(error)[:500]})
            if report is not None:
                lines = [f"klique: output {name} was not stored: {error}; it is kept at {folder / name}"]
                await report(task_id, "log", {"stream": "klique", "lines": lines}, None)
    return uploaded, failed


MAX_REASON = 500  # characters of a reason outside the task's own command that go into a result


free_port = free_loopback_port  # the node reporter's, which runs without the rest of the agent


def with_log_end(reason: str, log: str, count: int = 3) -> str:
    """A reason for stopping a run from outside its command (an app that never answered), with the last
    `count` lines of its output joined by " | ", at most MAX_REASON characters."""
    tail = " | ".join(line.strip() for line in log.splitlines()[-count:] if line.strip())
    return (f"{reason}; its log ends: {tail}" if tail else reason)[:MAX_REASON]


class Refused(Exception):
    """This environment cannot run the task; the message goes back to the plane as the reason.

    A permanent refusal (an unmapped user, a value that cannot go into a batch script, a partition the
    cluster does not have) fails the task: placing it again would be refused again. Otherwise the task
    goes back to the queue and waits.
    """

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def refuse_declared_volumes(assignment: Mapping[str, Any], backend: str) -> None:
    """A backend that mounts no declared volumes says so, rather than running the task without them."""
    declared = (assignment.get("spec") or {}).get("volumes")
    if declared:
        raise Refused(
            f"The task declares volumes, which a {backend} pool does not mount (its tasks see the "
            "host's own file systems). Submit it to a compute resource whose Kubernetes pools offer "
            "them, or leave spec.volumes out.",
            permanent=True,
        )


class Backend(Protocol):
    state: State
    upload: Upload | None

    @property
    def problem(self) -> str: ...  # what stops the environment from taking work (unreachable, RBAC), or ""
    @property
    def name(self) -> str: ...
    def inventory(self) -> dict[str, Any]: ...
    async def capacity(self) -> dict[str, Any]: ...  # cpus, cpus_in_use, nodes (gpus); {} when unknown
    def running(self) -> list[str]: ...
    def queue(self) -> list[dict[str, Any]]: ...
    def adopt(self, report: Report) -> list[str]: ...
    async def start(self, assignment: dict[str, Any], report: Report) -> None: ...
    async def stop(self, task_id: str, grace_seconds: float) -> None: ...
    async def stop_all(self, grace_seconds: float) -> None: ...
