"""Each bare-metal run's record, on disk before its runner is forked.

The agent's state is committed once per turn of its loop, after the turn's forks. An agent killed between
a fork and the commit that holds the run (or one that exits because SQLite rolled its state back) would
leave a runner nobody follows, and the plane would run the task a second time. So the start first writes
the run, its lease and attempt to a record, one line of JSON, and agents.zygote appends the runner's pid as
it forks, before it answers. A restarted agent reads the records its state lacks (BareMetal.adopt): a pid
means the runner is taken back; no pid means none was forked, and the record is forgotten.

Records live in numbered slot files of WORK_DIR/runs/, reused: a slot is created once and then overwritten,
because creating a file costs some hosts' file systems a hundred times what writing one does (about a
millisecond against ten microseconds), once per task. The writes are plain, without fsync: a runner
outlives its agent, never its host. A record cut short by a kill means no fork (the fork comes after the
record), and a slot is emptied when its run's end is reported, before the state forgets the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from agents.state import RunRecord

FOLDER = "runs"  # WORK_DIR/FOLDER/N: the slots
FORK_SECONDS = 5.0  # after its record is written, how long a runner's fork may take to be noted

__all__ = ["FOLDER", "FORK_SECONDS", "Found", "Records"]


@dataclass(frozen=True)
class Found:
    """A record read back from its slot: the run (its pid where the zygote noted one, else 0)."""

    run: RunRecord
    lease_id: str
    attempt: int

    @property
    def forked(self) -> bool:
        return self.run.pid > 0


@dataclass
class Records:
    folder: Path
    held: dict[str, Path] = field(default_factory=dict)  # task -> the slot of its record
    free: list[Path] = field(default_factory=list)
    made: int = 0  # the number the next new slot gets

    def write(self, run: RunRecord, lease_id: str, attempt: int) -> Path:
        """The run's record, in a free slot (OSError where it cannot be written: nothing is held then)."""
        slot = self.free.pop() if self.free else self._new()
        line = json.dumps({**asdict(run), "lease_id": lease_id, "attempt": attempt}).encode() + b"\n"
        try:
            with open(slot, "wb") as handle:
                handle.write(line)
        except OSError:
            self._empty(slot)
            raise
        self.held[run.task_id] = slot
        return slot

    def clear(self, task_id: str) -> None:
        """The task's run has ended or was never started: its slot is emptied and free again."""
        slot = self.held.pop(task_id, None)
        if slot is not None:
            self._empty(slot)

    def read(self) -> list[Found]:
        """Every record in the slots, for a restarted agent: the slots of ones cut short are freed, the
        others held under their tasks. A record without a pid is read again until FORK_SECONDS after it
        was written: a fork asked for as the last agent was killed may still be on its way."""
        found: list[Found] = []
        listed = self.folder.iterdir() if self.folder.is_dir() else iter(())
        slots = sorted((slot for slot in listed if slot.name.isdigit()), key=lambda slot: int(slot.name))
        self.made = max((int(slot.name) + 1 for slot in slots), default=0)
        for slot in slots:
            record = _waited(slot)
            if record is None or record.run.task_id in self.held:
                self._empty(slot)
                continue
            self.held[record.run.task_id] = slot
            found.append(record)
        return found

    def _new(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        slot = self.folder / str(self.made)
        self.made += 1
        return slot

    def _empty(self, slot: Path) -> None:
        with contextlib.suppress(OSError):
            os.truncate(slot, 0)
            self.free.append(slot)


def _waited(slot: Path) -> Found | None:
    while True:
        try:
            data = slot.read_bytes()
            written = slot.stat().st_mtime
        except OSError:
            return None
        record = _parsed(data)
        if record is None or record.forked or time.time() > written + FORK_SECONDS:
            return record
        time.sleep(0.05)


def _parsed(data: bytes) -> Found | None:
    """A slot's record; None for an empty slot or a record cut short."""
    line, whole, rest = data.partition(b"\n")
    if not whole:
        return None  # no whole line: cut short as it was written, so nothing was forked
    try:
        written = json.loads(line)
        lease_id, attempt = str(written.pop("lease_id")), int(written.pop("attempt"))
        run = RunRecord(**written)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    noted = rest.strip()
    return Found(replace(run, pid=int(noted) if noted.isdigit() else 0), lease_id, attempt)
