"""The agent's durable state, in SQLite beside its work: the runs it owns and the outbox.

Every report gets the next sequence number of its task and goes into the outbox in the same SQLite
transaction that records how far the task's log has been read; it leaves the outbox only when the plane
acknowledges it. So after a crash, a restart or a cut connection, what was not acknowledged is sent again
(the plane keeps each sequence number once) and nothing read is read twice.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunRecord:
    task_id: str
    pid: int
    log_path: str
    exit_path: str
    offset: int
    devices: list[int]
    units: int
    outputs: list[str]  # file patterns the task declared, uploaded when it ends
    mig: list[str] = field(default_factory=list)  # UUIDs of the MIG slices it holds


@dataclass(frozen=True)
class JobRecord:
    """A task handed to a batch system (Slurm, PBS, LSF) as a job, followed by its job id."""

    task_id: str
    job_id: str
    folder: str  # the task's folder on the cluster: token, script, output, exit code
    account: str  # the Linux account it runs as
    stopping: bool = False
    last: str = ""  # the state and reason last reported, so that only changes go out


class State:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(
            """
            CREATE TABLE IF NOT EXISTS runs (task_id TEXT PRIMARY KEY, pid INTEGER, log_path TEXT,
                exit_path TEXT, "offset" INTEGER, devices TEXT, units INTEGER, outputs TEXT DEFAULT '[]',
                mig TEXT DEFAULT '[]');
            CREATE TABLE IF NOT EXISTS outbox (
                task_id TEXT, seq INTEGER, message TEXT, PRIMARY KEY (task_id, seq));
            CREATE TABLE IF NOT EXISTS sequences (task_id TEXT PRIMARY KEY, last INTEGER);
            CREATE TABLE IF NOT EXISTS jobs (task_id TEXT PRIMARY KEY, job_id TEXT, folder TEXT,
                account TEXT, stopping INTEGER DEFAULT 0, last TEXT DEFAULT '');
            """
        )

    def add_run(self, run: RunRecord) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                run.task_id,
                run.pid,
                run.log_path,
                run.exit_path,
                run.offset,
                json.dumps(run.devices),
                run.units,
                json.dumps(run.outputs),
                json.dumps(run.mig),
            ),
        )

    def remove_run(self, task_id: str) -> None:
        self.db.execute("DELETE FROM runs WHERE task_id = ?", (task_id,))

    def runs(self) -> list[RunRecord]:
        rows = self.db.execute(
            'SELECT task_id, pid, log_path, exit_path, "offset", devices, units, outputs, mig FROM runs'
        ).fetchall()
        return [
            RunRecord(
                task,
                pid,
                log,
                exit_path,
                offset,
                json.loads(devices),
                units,
                json.loads(outputs),
                json.loads(mig),
            )
            for task, pid, log, exit_path, offset, devices, units, outputs, mig in rows
        ]

    def add_job(self, job: JobRecord) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?)",
            (job.task_id, job.job_id, job.folder, job.account, int(job.stopping), job.last),
        )

    def jobs(self) -> list[JobRecord]:
        rows = self.db.execute(
            "SELECT task_id, job_id, folder, account, stopping, last FROM jobs ORDER BY rowid"
        )
        return [
            JobRecord(task, job, folder, account, bool(stopping), last)
            for task, job, folder, account, stopping, last in rows.fetchall()
        ]

    def job_seen(self, task_id: str, last: str) -> None:
        self.db.execute("UPDATE jobs SET last = ? WHERE task_id = ?", (last, task_id))

    def job_stopping(self, task_id: str) -> None:
        self.db.execute("UPDATE jobs SET stopping = 1 WHERE task_id = ?", (task_id,))

    def remove_job(self, task_id: str) -> None:
        self.db.execute("DELETE FROM jobs WHERE task_id = ?", (task_id,))

    def offset(self, task_id: str) -> int:
        row = self.db.execute('SELECT "offset" FROM runs WHERE task_id = ?', (task_id,)).fetchone()
        return int(row[0]) if row else 0

    def enqueue(
        self, task_id: str, kind: str, body: dict[str, Any], *, offset: int | None = None
    ) -> dict[str, Any]:
        """Number the report and keep it until acknowledged; move the log offset in the same transaction."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute("SELECT last FROM sequences WHERE task_id = ?", (task_id,)).fetchone()
            seq = (row[0] if row else 0) + 1
            message = {"type": kind, "task_id": task_id, "seq": seq, **body}
            self.db.execute("INSERT OR REPLACE INTO sequences VALUES (?, ?)", (task_id, seq))
            self.db.execute("INSERT INTO outbox VALUES (?, ?, ?)", (task_id, seq, json.dumps(message)))
            if offset is not None:
                self.db.execute('UPDATE runs SET "offset" = ? WHERE task_id = ?', (offset, task_id))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return message

    def acknowledge(self, task_id: str, seq: int) -> None:
        self.db.execute("DELETE FROM outbox WHERE task_id = ? AND seq = ?", (task_id, seq))

    def pending(self) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT message FROM outbox ORDER BY rowid").fetchall()
        return [json.loads(message) for (message,) in rows]
