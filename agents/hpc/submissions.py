"""The submissions an HPC agent has made, on disk before their commands run.

A job is in the cluster once its submission command (sbatch, qsub, bsub) is answered, but the agent learns
its id only when the command returns, and commits that to its state once per turn of its loop. An agent
killed in between would leave a job that nobody follows, and the plane would submit the task again. So a
submission first writes its record (the task, its job folder and account, its app, its lease and attempt)
to the agent's own folder, and the command's output goes to a file beside the record instead of a pipe:
the command finishes even after its agent is gone, and its answer (the job id) can still be read. A
restarted agent takes back the jobs of the records its state lacks (agents.hpc.backend.Batch.adopt), and
forgets those whose command printed no job id. Both files go when the job's end is reported, before the
state forgets the job, or when the submission is refused.

The folder is the agent's own (0700, beside its state): a cluster account never reaches it, so it cannot
plant a job id there for the agent to follow.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["Submission", "Submissions"]


@dataclass(frozen=True)
class Submission:
    task_id: str
    folder: str  # the job's folder, which the account owns
    account: str
    app: str  # the app's spec as JSON, "" for none
    lease_id: str
    attempt: int


@dataclass(frozen=True)
class Found:
    """A submission read back by a restarted agent, and when it was recorded (its command's answer is read
    on each look: `output`)."""

    submission: Submission
    recorded_at: float  # seconds since the epoch


class Submissions:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def begin(self, submission: Submission) -> BinaryIO:
        """Record the submission; the file its command's output goes to, open (the caller closes it).
        OSError where either cannot be written (nothing is left then)."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        record, output = self._paths(submission.task_id)
        try:
            record.write_text(json.dumps(asdict(submission)))
            return open(output, "w+b")  # the caller closes it once the command has ended
        except OSError:
            self.end(submission.task_id)
            raise

    def end(self, task_id: str) -> None:
        """The submission's job has ended and been reported, or it was never made: its files go."""
        for path in self._paths(task_id):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def found(self) -> list[Found]:
        """Every submission recorded here; a record that cannot be read (cut short by a kill as it was
        written, so its command never ran) is removed."""
        found: list[Found] = []
        for record in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            task_id = record.name.removesuffix(".json")
            try:
                submission = Submission(**json.loads(record.read_text()))
                recorded_at = record.stat().st_mtime
            except (OSError, ValueError, TypeError):
                self.end(task_id)
                continue
            if submission.task_id != task_id:
                self.end(task_id)
                continue
            found.append(Found(submission, recorded_at))
        return found

    def output(self, task_id: str) -> str:
        """What the submission's command has printed so far."""
        try:
            return self._paths(task_id)[1].read_text(errors="replace")
        except OSError:
            return ""

    def _paths(self, task_id: str) -> tuple[Path, Path]:
        return self.folder / f"{task_id}.json", self.folder / f"{task_id}.out"
