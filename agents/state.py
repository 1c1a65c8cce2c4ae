"""The agent's durable state, in SQLite beside its work: the runs it owns, their leases and the outbox.

Each run is known by its task and the lease the plane handed it out under. Every report names that lease,
gets the next sequence number of its run and goes into the outbox in the same SQLite transaction that
records how far the task's log has been read; it leaves the outbox when the plane answers it with a
verdict (applied, duplicate or stale). So after a crash, a restart or a cut connection, what was not
answered is sent again (the plane keeps each number once), nothing read is read twice, and a report the
plane will never apply (its run was given to another attempt) is dropped rather than kept forever.

Each change is whole (one statement, or a savepoint around several). Alone, each is its own transaction,
written through to the disk before it returns. A running agent groups them (`group_commits`): what one
turn of its event loop changes is one transaction, committed (one sync of the disk, not one per change)
before anything that depends on it is sent; see agents.main.Agent._flush.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
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
    """A task handed to a batch system (Slurm, PBS, LSF) or to Kubernetes as a job, followed by its id."""

    task_id: str
    job_id: str  # the batch system's job id; on Kubernetes, the Job's name
    folder: str  # the task's folder on the cluster (token, script, output, exit code); on Kubernetes, the
    # namespace the Job is in
    account: str  # the Linux account it runs as; on Kubernetes, the submitter
    stopping: bool = False
    last: str = ""  # the state and reason last reported, so that only changes go out
    kind: str = "Job"  # on Kubernetes, what job_id names: a Job, a JobSet (whose Job runs it) or a PyTorchJob
    app: str = ""  # an app's run: its spec's app section (JSON), to open its tunnel again after a restart


@dataclass(frozen=True)
class LogCursor:
    """How far a pod's log has been read: the timestamp of the last line sent and how many lines with that
    very timestamp were sent (the kubelet stamps lines to the nanosecond, but two can still share one)."""

    pod: str
    since: str  # RFC 3339 with nanoseconds, as the kubelet wrote it; "" before the first line
    seen: int


class StateLost(sqlite3.Error):
    """Changes this State was asked to keep are not on disk (SQLite rolled them back): what the agent holds
    in memory no longer matches its state; only a restart, which reads the state again, makes them agree."""


Position = int | LogCursor  # where a report leaves its task's output: a file offset, or a pod's log cursor


class State:
    """Opened at its first use, not when made: an agent that stands by for its Lease has not touched the
    file its leader writes. `shared`: the file is on a volume that agents of several hosts mount, one at a
    time (ReadWriteMany, with leader election); SQLite's write-ahead log needs memory shared by every
    process that opens the file, which hosts do not share, so a shared state keeps a rollback journal."""

    def __init__(self, path: Path, *, shared: bool = False) -> None:
        self.path, self.shared = path, shared
        self._db: sqlite3.Connection | None = None
        self._runs: dict[str, RunRecord] | None = None  # the runs table, as committed or being committed
        self._opened: Callable[[], None] | None = None  # told when a grouped transaction begins
        self._lost = False  # a grouped transaction was rolled back by SQLite, not committed
        self.commits = 0  # grouped transactions written through so far

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = self._open()
        return self._db

    # Transactions ----------------------------------------------------------------------------------------

    def group_commits(self, opened: Callable[[], None] | None) -> None:
        """From now on a change does not commit by itself: the first one opens a transaction (and calls
        `opened`, so that its owner commits soon), the next ones join it, and `commit` ends it. Its owner
        sends nothing that depends on a change before the change is committed. None: each change commits
        by itself again (commit what is open first)."""
        self._opened = opened

    @property
    def uncommitted(self) -> bool:
        return self._db is not None and self._db.in_transaction

    def commit(self) -> None:
        """Write what the open transaction holds through to the disk; nothing if none is open.

        sqlite3.Error with the transaction still open (`uncommitted`): nothing is lost, the commit may be
        tried again (a busy or a full disk). StateLost: SQLite rolled the transaction back, on this commit
        or on a change before it; what it held is not on disk, and this State now holds what the file does."""
        lost, self._lost = self._lost, False
        if not lost and self.uncommitted:
            try:
                self.db.execute("COMMIT")
            except sqlite3.Error as error:
                if self.uncommitted:
                    raise
                self._runs = None
                raise StateLost(f"the agent's state could not be written: {error}") from error
            self.commits += 1
        if lost:
            self.rollback()  # nor keep what changed since, in a transaction of its own
            raise StateLost("the agent's state could not be written: SQLite rolled back a change")

    def rollback(self) -> None:
        """Give up the open transaction: what the file holds is what this State holds again."""
        if self.uncommitted:
            self.db.execute("ROLLBACK")
        self._lost = False
        self._runs = None

    @contextlib.contextmanager
    def _change(self) -> Iterator[sqlite3.Connection]:
        """One change of several statements, whole: its own transaction, or a savepoint of the one open."""
        db = self.db
        if not db.in_transaction:
            if self._opened is None:
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
                return
            self._join(db)
        db.execute("SAVEPOINT change")
        try:
            yield db
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK TO change")
                db.execute("RELEASE change")
            else:  # SQLite rolled the whole transaction back (a full disk, an I/O error)
                self._lose()
            raise
        db.execute("RELEASE change")

    def _write(self, sql: str, parameters: tuple[Any, ...] = ()) -> None:
        """One statement of change (whole by itself): at once alone, or in the group's transaction."""
        db = self.db
        if self._opened is None:
            db.execute(sql, parameters)
            return
        self._join(db)
        try:
            db.execute(sql, parameters)
        except sqlite3.Error:
            if not db.in_transaction:
                self._lose()
            raise

    def _lose(self) -> None:
        """The group's transaction is gone without a commit: what it held is not on disk, and `commit`
        says so (StateLost) rather than carry on as if it were."""
        self._lost = True
        self._runs = None

    def _join(self, db: sqlite3.Connection) -> None:
        if not db.in_transaction:
            db.execute("BEGIN IMMEDIATE")
            assert self._opened is not None
            self._opened()

    def _open(self) -> sqlite3.Connection:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None, timeout=30)
        if self.shared:
            db.execute("PRAGMA journal_mode=DELETE")
            db.execute("PRAGMA synchronous=FULL")
        else:
            db.execute("PRAGMA journal_mode=WAL")
        db.executescript(
            """
            CREATE TABLE IF NOT EXISTS runs (task_id TEXT PRIMARY KEY, pid INTEGER, log_path TEXT,
                exit_path TEXT, "offset" INTEGER, devices TEXT, units INTEGER, outputs TEXT DEFAULT '[]',
                mig TEXT DEFAULT '[]');
            CREATE TABLE IF NOT EXISTS leases (task_id TEXT PRIMARY KEY, lease_id TEXT, attempt INTEGER);
            CREATE TABLE IF NOT EXISTS reports (
                task_id TEXT, lease_id TEXT, seq INTEGER, message TEXT, PRIMARY KEY (task_id, lease_id, seq));
            CREATE TABLE IF NOT EXISTS run_sequences (
                task_id TEXT, lease_id TEXT, last INTEGER, PRIMARY KEY (task_id, lease_id));
            CREATE TABLE IF NOT EXISTS jobs (task_id TEXT PRIMARY KEY, job_id TEXT, folder TEXT,
                account TEXT, stopping INTEGER DEFAULT 0, last TEXT DEFAULT '', kind TEXT DEFAULT 'Job',
                app TEXT DEFAULT '');
            CREATE TABLE IF NOT EXISTS pod_logs (task_id TEXT, pod TEXT, since TEXT, seen INTEGER,
                PRIMARY KEY (task_id, pod));
            """
        )

        # The jobs of an agent from before JobSets were made are all Jobs.
        # Those from before apps ran on HPC pools are no apps.
        columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        if "kind" not in columns:
            db.execute("ALTER TABLE jobs ADD COLUMN kind TEXT DEFAULT 'Job'")
        if "app" not in columns:
            db.execute("ALTER TABLE jobs ADD COLUMN app TEXT DEFAULT ''")

        # The outbox of an agent from before leases: its reports name no run (lease ""), and numbering goes
        # on from where it was; the plane puts them in the task's current run if this agent holds it.
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'outbox'").fetchone():
            db.executescript(
                """
                INSERT OR IGNORE INTO reports SELECT task_id, '', seq, message FROM outbox;
                INSERT OR IGNORE INTO run_sequences SELECT task_id, '', last FROM sequences;
                DROP TABLE outbox;
                DROP TABLE sequences;
                """
            )
        return db

    # Leases ----------------------------------------------------------------------------------------------

    def lease_begin(self, task_id: str, lease_id: str, attempt: int) -> None:
        """The run this agent holds of the task from now on: its reports name this lease, numbered from 1."""
        self._write("INSERT OR REPLACE INTO leases VALUES (?, ?, ?)", (task_id, lease_id, attempt))

    def leases(self) -> dict[str, str]:
        """Every task's lease held here: task -> lease."""
        return {
            str(task): str(lease) for task, lease in self.db.execute("SELECT task_id, lease_id FROM leases")
        }

    def lease(self, task_id: str) -> str:
        """The lease of the task's run here ("" for none)."""
        row = self.db.execute("SELECT lease_id FROM leases WHERE task_id = ?", (task_id,)).fetchone()
        return str(row[0]) if row else ""

    def lease_end(self, task_id: str) -> None:
        """Forget the task's lease once the run is gone and nothing of it waits in the outbox."""
        busy = self.db.execute(
            "SELECT 1 FROM runs WHERE task_id = ? UNION SELECT 1 FROM jobs WHERE task_id = ? "
            "UNION SELECT 1 FROM reports WHERE task_id = ?",
            (task_id, task_id, task_id),
        ).fetchone()
        if not busy:
            with self._change() as db:
                db.execute("DELETE FROM leases WHERE task_id = ?", (task_id,))
                db.execute("DELETE FROM run_sequences WHERE task_id = ?", (task_id,))

    def add_run(self, run: RunRecord) -> None:
        self._write(
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
        runs = self._known_runs()
        runs.pop(run.task_id, None)  # a run added again goes last, as in the table
        runs[run.task_id] = run

    def remove_run(self, task_id: str) -> None:
        self._write("DELETE FROM runs WHERE task_id = ?", (task_id,))
        self._known_runs().pop(task_id, None)

    def runs(self) -> list[RunRecord]:
        return list(self._known_runs().values())

    def run(self, task_id: str) -> RunRecord | None:
        return self._known_runs().get(task_id)

    def _known_runs(self) -> dict[str, RunRecord]:
        """The runs table, read once: this State is its only writer, and keeps this copy as it writes."""
        if self._runs is None:
            rows = self.db.execute(
                'SELECT task_id, pid, log_path, exit_path, "offset", devices, units, outputs, mig FROM runs '
                "ORDER BY rowid"
            ).fetchall()
            self._runs = {
                task: RunRecord(
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
            }
        return self._runs

    def add_job(self, job: JobRecord) -> None:
        stopping = int(job.stopping)
        row = (job.task_id, job.job_id, job.folder, job.account, stopping, job.last, job.kind, job.app)
        self._write(
            "INSERT OR REPLACE INTO jobs (task_id, job_id, folder, account, stopping, last, kind, app) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            row,
        )

    def jobs(self) -> list[JobRecord]:
        rows = self.db.execute(
            "SELECT task_id, job_id, folder, account, stopping, last, kind, app FROM jobs ORDER BY rowid"
        )
        return [
            JobRecord(task, job, folder, account, bool(stopping), last, kind or "Job", app or "")
            for task, job, folder, account, stopping, last, kind, app in rows.fetchall()
        ]

    def job_seen(self, task_id: str, last: str) -> None:
        self._write("UPDATE jobs SET last = ? WHERE task_id = ?", (last, task_id))

    def job_stopping(self, task_id: str) -> None:
        self._write("UPDATE jobs SET stopping = 1 WHERE task_id = ?", (task_id,))

    def remove_job(self, task_id: str) -> None:
        with self._change() as db:
            db.execute("DELETE FROM jobs WHERE task_id = ?", (task_id,))
            db.execute("DELETE FROM pod_logs WHERE task_id = ?", (task_id,))

    def log_cursor(self, task_id: str, pod: str) -> LogCursor:
        row = self.db.execute(
            "SELECT since, seen FROM pod_logs WHERE task_id = ? AND pod = ?", (task_id, pod)
        ).fetchone()
        return LogCursor(pod, str(row[0]), int(row[1])) if row else LogCursor(pod, "", 0)

    def offset(self, task_id: str) -> int:
        run = self.run(task_id)
        return run.offset if run is not None else 0

    def enqueue(
        self, task_id: str, kind: str, body: dict[str, Any], *, offset: Position | None = None
    ) -> dict[str, Any]:
        """Number the report in its run and keep it until answered; move the log offset (or the pod's log
        cursor) in the same transaction, so a line is neither lost nor sent twice across a crash."""
        with self._change() as db:
            lease = self.lease(task_id)
            row = db.execute(
                "SELECT last FROM run_sequences WHERE task_id = ? AND lease_id = ?", (task_id, lease)
            ).fetchone()
            seq = (row[0] if row else 0) + 1
            message = {**body, "type": kind, "task_id": task_id, "lease_id": lease, "seq": seq}
            db.execute("INSERT OR REPLACE INTO run_sequences VALUES (?, ?, ?)", (task_id, lease, seq))
            db.execute("INSERT INTO reports VALUES (?, ?, ?, ?)", (task_id, lease, seq, json.dumps(message)))
            if isinstance(offset, LogCursor):
                db.execute(
                    "INSERT OR REPLACE INTO pod_logs VALUES (?, ?, ?, ?)",
                    (task_id, offset.pod, offset.since, offset.seen),
                )
            elif offset is not None:
                db.execute('UPDATE runs SET "offset" = ? WHERE task_id = ?', (offset, task_id))
        if isinstance(offset, int) and (run := self.run(task_id)) is not None:
            self._known_runs()[task_id] = replace(run, offset=offset)  # once the change is whole
        return message

    def run_ended(self, task_id: str, lease_id: str) -> bool:
        """Whether the run's result waits in the outbox: it ended here, however it looks in the cluster."""
        rows = self.db.execute(
            "SELECT message FROM reports WHERE task_id = ? AND lease_id = ?", (task_id, lease_id)
        ).fetchall()
        return any(json.loads(message).get("type") == "result" for (message,) in rows)

    def acknowledge(self, task_id: str, lease_id: str, seq: int) -> None:
        """The plane answered the report (applied, duplicate or stale): it leaves the outbox."""
        with self._change() as db:
            db.execute(
                "DELETE FROM reports WHERE task_id = ? AND lease_id = ? AND seq = ?", (task_id, lease_id, seq)
            )
            if self.lease(task_id) == lease_id:
                self.lease_end(task_id)
            elif not db.execute(
                "SELECT 1 FROM reports WHERE task_id = ? AND lease_id = ?", (task_id, lease_id)
            ).fetchone():  # an earlier run's last report: nothing more will be numbered in it
                db.execute(
                    "DELETE FROM run_sequences WHERE task_id = ? AND lease_id = ?", (task_id, lease_id)
                )

    def pending(self) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT message FROM reports ORDER BY rowid").fetchall()
        return [json.loads(message) for (message,) in rows]

    def pending_runs(self) -> set[tuple[str, str]]:
        """The runs (task, lease) with reports the plane has not answered."""
        return {
            (task, lease) for task, lease in self.db.execute("SELECT DISTINCT task_id, lease_id FROM reports")
        }
