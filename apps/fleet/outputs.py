"""The files a run declares as outputs, one set per run: kept by the plane (streamed to disk with their
SHA-256, renamed into place whole), or, for a project with an output bucket, stored by the agent in the
bucket with a ticket and recorded here at its receipt (protocol/outputs.py)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import tempfile
from datetime import datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from django.conf import settings
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone

from apps.fleet import buckets
from apps.fleet.models import OutputDestination, TaskOutput
from apps.metering.ledger import Event, Report, ingest
from apps.metering.models import Kind
from apps.scheduling.models import Task
from tenants import due

if TYPE_CHECKING:
    from tenants.models import Tenant
from apps.fleet.errors import AgentRejected, OutputNotStored
from protocol import outputs as protocol_outputs

logger = logging.getLogger(__name__)


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


MAX_OUTPUT_DEPTH = 16


def _output_name(name: str) -> str:
    """A relative path of plain names inside the task's folder ("metrics.json", "eval/scores.csv")."""
    parts = PurePosixPath(name).parts
    plain = all(part not in ("", ".", "..") and len(part) <= 255 and "\\" not in part for part in parts)
    if (
        not parts
        or name.startswith("/")
        or not plain
        or len(parts) > MAX_OUTPUT_DEPTH
        or len(name) > 500
        or "\x00" in name
    ):
        raise AgentRejected(
            f"{name[:100]!r} cannot name an output: give a relative path of plain names inside the task's "
            f"folder (no '..', at most {MAX_OUTPUT_DEPTH} levels and 500 characters)."
        )
    return str(PurePosixPath(*parts))


def _store_error(name: str, error: OSError) -> OutputNotStored:
    """What went wrong keeping an output, in words: the plane's disk full, its store not writable, or a
    name that is a folder (or under a file) in what the task uploaded before."""
    causes = {
        errno.ENOSPC: ("the plane's file store is full", 507),
        errno.EDQUOT: ("the plane's file store is over its quota", 507),
        errno.EACCES: ("the plane's file store is not writable", 503),
        errno.EROFS: ("the plane's file store is read-only", 503),
        errno.EISDIR: ("a folder of that name holds other outputs", 409),
        errno.ENOTDIR: ("a part of its path is an output file already", 409),
        errno.EEXIST: ("a part of its path is an output file already", 409),
    }
    cause, status = causes.get(error.errno or 0, (f"the file store failed ({error.strerror})", 503))
    logger.warning("output %s not stored: %s", name, cause)
    return OutputNotStored(f"Output {name} could not be stored: {cause}.", status)


@transaction.atomic
def output_store(*, tenant: Tenant, task: Task, name: str, content: Readable, sha256: str = "") -> TaskOutput:
    """Keep a file the task's current run declared as output, replacing an earlier upload of the same
    name in that run (each run has its own set). The caller has checked that the uploader may write this
    run's outputs (its pool's agent under the run's lease, or the run's task token). With `sha256`, a file
    whose content does not match is not kept (422: the agent sends it again)."""
    name = _output_name(name)
    destination = buckets.current(task.project)
    if destination is not None:
        raise OutputNotStored(
            f"Project {task.project}'s outputs go to {destination}, not to the plane: ask for a ticket "
            f"(POST {protocol_outputs.tickets_path(str(task.pk), name)}) and store it there.",
            409,
        )
    stored = f"{tenant.schema_name}/{task.pk}/{task.lease_id}/{name}"
    target = Path(default_storage.path(stored))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        size, digest = _write_atomically(target, name, content, sha256.lower())
    except OSError as error:
        raise _store_error(name, error) from None
    output, _ = TaskOutput.objects.update_or_create(
        task=task,
        lease_id=task.lease_id,
        name=name,
        defaults={"size": size, "sha256": digest, "stored": stored, "at": timezone.now()},
    )
    due.mark_on_commit(tenant.schema_name, "storage")  # its hours are metered from now on
    return output


def outputs_to_meter() -> bool:
    """Whether the plane keeps some output of the tenant's (its storage is metered every hour)."""
    return TaskOutput.objects.filter(destination__isnull=True).exists()


def output_ticket(*, task: Task, name: str, claim: protocol_outputs.Claim) -> protocol_outputs.Ticket:
    """Where the task's current run stores output `name`: the plane's file store, or its project's
    bucket, through a URL good for that one object (under this run's lease) and a few minutes."""
    name = _output_name(name)
    destination = buckets.current(task.project)
    if destination is None:
        return protocol_outputs.Ticket(store=protocol_outputs.PLANE)
    _check_residency(task, destination)
    return buckets.put_ticket(
        destination, buckets.key_of(destination, str(task.pk), str(task.lease_id), name), claim
    )


def _check_residency(task: Task, destination: OutputDestination) -> None:
    regions = task.project.regions if task.project else []
    if regions and destination.region not in regions:
        raise OutputNotStored(
            f"Project {task.project} is limited to {', '.join(regions)} but its output bucket {destination} "
            f"is in {destination.region}: an admin of the project sets a bucket in one of its regions.",
            409,
        )


@transaction.atomic
def output_receipt(*, task: Task, name: str, claim: protocol_outputs.Claim) -> TaskOutput:
    """Record an output the agent says it stored in the project's bucket with a ticket, once the bucket
    shows it as claimed (NotInBucket otherwise: 422 store it again, 503 ask later)."""
    name = _output_name(name)
    destination = buckets.current(task.project)
    if destination is None:
        raise OutputNotStored(
            f"Project {task.project or '(none)'} keeps its outputs on the plane: PUT {name} to "
            f"{protocol_outputs.plane_path(str(task.pk), name)}.",
            409,
        )
    key = buckets.key_of(destination, str(task.pk), str(task.lease_id), name)
    try:
        buckets.check_object(destination, key, claim)
    except buckets.NotInBucket as missing:
        raise OutputNotStored(str(missing), missing.status) from None
    output, _ = TaskOutput.objects.update_or_create(
        task=task,
        lease_id=task.lease_id,
        name=name,
        defaults={
            "size": claim.size,
            "sha256": claim.sha256,
            "stored": key,
            "destination": destination,
            "at": timezone.now(),
        },
    )
    return output


def _copy(content: Readable, handle: Any, name: str) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    while chunk := content.read(1024 * 1024):
        size += len(chunk)
        if size > settings.KLIQUE_MAX_OUTPUT_BYTES:
            raise OutputNotStored(
                f"Output {name} is larger than {settings.KLIQUE_MAX_OUTPUT_BYTES} bytes.", 413
            )
        digest.update(chunk)
        handle.write(chunk)
    handle.flush()
    os.fsync(handle.fileno())
    return size, digest.hexdigest()


def _check_digest(name: str, got: str, expected: str) -> None:
    if expected and got != expected:
        raise OutputNotStored(
            f"Output {name} arrived with SHA-256 {got}, not the {expected} the agent sent; send it again.",
            422,
        )


def _write_atomically(target: Path, name: str, content: Readable, expected: str = "") -> tuple[int, str]:
    """Stream the upload to a temporary file beside `target`, hashing it, then rename it into place: the
    file is never held in memory, and a reader never sees half of it (nor a crash, nor a full disk, leaves
    half of it, or an empty one)."""
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=".upload-")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            written = _copy(content, handle, name)
        _check_digest(name, written[1], expected)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return written


def meter_outputs(*, now: datetime | None = None, hours: int = 3) -> Report:
    """Meter task outputs the plane kept over the last `hours` whole hours: bytes x time, one event per
    output and hour (so a rerun of this after a missed hour still meters it, once). Outputs in a project's
    own bucket are not the plane's to meter: the bucket's cloud bills them."""

    now = now or timezone.now()
    end = now.replace(minute=0, second=0, microsecond=0)
    events = []
    outputs = TaskOutput.objects.select_related("task", "task__project", "task__submitter").filter(
        at__lt=end, destination__isnull=True
    )
    for output in outputs:
        for hour in range(hours, 0, -1):
            window_start, window_end = end - timedelta(hours=hour), end - timedelta(hours=hour - 1)
            start = max(window_start, output.at)
            if start >= window_end:
                continue
            task = output.task
            events.append(
                Event(
                    event_id=f"storage:{output.pk}:{window_start:%Y%m%d%H}",
                    kind=Kind.STORAGE,
                    started_at=start,
                    ended_at=window_end,
                    user=task.submitter.username,
                    project=task.project.name if task.project else "",
                    bytes=output.size,
                    source="storage",
                )
            )
    return ingest(events, now=now) if events else Report()
