"""The HPC backends: Klique hands a task to Slurm, PBS or LSF as a batch job of the user's own account.

Klique never replaces the cluster's scheduler: the agent on a login node renders the task's batch script
(protocol.batch, protocol.scripts), submits it with the cluster's own command as the Linux account the
user maps to, and follows the job with batched queries of the cluster's queue and accounting. The job's
node reporter (agents.node) sends output and outputs over HTTPS with the task's own token; this agent
sends the job's state as the cluster sees it (pending with the cluster's reason, running, ended with the
exit code).

Nothing runs through a shell string: every command is an argument list, the script goes to the cluster
as a file or on stdin, and every value a task gives is checked or quoted by protocol.batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from agents.backend import Refused, Report, Upload, refuse_declared_volumes, with_log_end
from agents.hpc.apps import ADDRESS_FILE, AddressInvalid, ports
from agents.hpc.cluster import (
    COMMAND_SECONDS,
    OUTPUT_TAIL_LINES,
    TRANSIENT,
    ClusterUnavailable,
    Completed,
    Execute,
    JobStatus,
    Settings,
    agent_environment,
    execute,
    install_node_script,
    read_owned,
)
from agents.hpc.lsf import Lsf
from agents.hpc.pbs import Pbs
from agents.hpc.slurm import Slurm
from agents.hpc.submissions import Found, Submission, Submissions
from agents.relay import NodeRelay, new_key
from agents.state import JobRecord, State
from protocol import environment as task_environment
from protocol.apps import AppSpec
from protocol.batch import (
    TemplateInvalid,
    Unsafe,
)
from protocol.scripts import APP_KEY_FILE, Scripts

logger = logging.getLogger("klique.agent.hpc")

APP_LOOK_SECONDS = 1.0  # how often the agent looks for a running app's relay

DIALECTS: dict[str, type[Slurm] | type[Pbs] | type[Lsf]] = {"slurm": Slurm, "pbs": Pbs, "lsf": Lsf}


@dataclass
class Batch:
    """One cluster: submits, follows, signals and cancels its tasks' jobs."""

    dialect: Slurm | Pbs | Lsf
    settings: Settings
    state: State
    url: str
    run: Execute = execute
    upload: Upload | None = None  # outputs go up from the compute node, not through the agent
    polled: dict[str, tuple[str, JobStatus]] = field(default_factory=dict)  # task -> (job, last seen)
    problem: str = ""  # the cluster's last complaint when its queue could not be read
    poller: asyncio.Task[None] | None = None
    reporter: Report | None = None
    reasons: dict[str, str] = field(default_factory=dict)  # task -> why the agent stopped its run
    submissions: Submissions = field(init=False)
    unanswered: dict[str, Found] = field(default_factory=dict)  # task -> a submission a killed agent left
    stop_on_answer: set[str] = field(default_factory=set)  # unanswered tasks the plane asked to stop

    def __post_init__(self) -> None:
        self.submissions = Submissions(Path(self.state.path).parent / "submissions")

    @property
    def name(self) -> str:
        return self.dialect.name

    def inventory(self) -> dict[str, Any]:
        return {"scheduler": self.name, "source": "batch", "jobs": len(self.state.jobs())}

    async def capacity(self) -> dict[str, int]:
        """The cluster's CPUs (those in use) and nodes, as its own commands say; {} while it cannot."""
        try:
            found = await self.dialect.capacity(self._run)
        except ClusterUnavailable as error:
            logger.warning("the %s nodes cannot be read: %s", self.name, error)
            return {}
        return found.as_dict() if found else {}

    def running(self) -> list[str]:
        """The tasks whose jobs this agent follows, and those whose submissions' answers it waits for."""
        return sorted({job.task_id for job in self.state.jobs()} | set(self.unanswered))

    def queue(self) -> list[dict[str, Any]]:
        """The cluster's view of Klique's jobs, as last polled: for the pool's queue in the API."""
        return [
            {"task_id": task, "job_id": job, "state": status.state, "cluster_state": status.raw,
             "reason": status.reason}
            for task, (job, status) in sorted(self.polled.items())
        ]  # fmt: skip

    # Submission -------------------------------------------------------------------------------------

    def account_for(self, user: str) -> str:
        account = self.settings.user_map.get(user) or self.settings.default_account
        if not account:
            raise Refused(
                f"User {user or '?'} has no Linux account on this cluster: ask an administrator to map them "
                f"in [agent.{self.name}.user_map] of the agent's configuration.",
                permanent=True,
            )
        try:
            pwd.getpwnam(account)
        except KeyError:
            raise Refused(
                f"User {user} maps to Linux account {account}, which does not exist on this login node.",
                permanent=True,
            ) from None
        if os.geteuid() != 0 and account != pwd.getpwuid(os.geteuid()).pw_name:
            raise Refused(
                f"The agent runs as {pwd.getpwuid(os.geteuid()).pw_name} and cannot submit as {account}; "
                "run it as root (it submits as each account) or map users to its own account.",
                permanent=True,
            )
        return account

    def _prepare(self, folder: Path, account: str, token: str, script: str, app_key: str = "") -> Path:
        """A fresh folder for the task, owned by the account the job runs as: token (0600), script, and an
        app's key.

        Everything is written while the folder is still root's alone and handed over last, so the
        account can never swap a file for a link while the agent writes (a run before this one leaves
        its folder to the account: it is removed first, without following links)."""
        if folder.is_symlink() or folder.exists():
            shutil.rmtree(folder)  # rmtree does not follow symbolic links
        folder.mkdir(mode=0o700)
        user = pwd.getpwnam(account)
        script_path = folder / "job.sh"
        files = [(folder / "token", token), (script_path, script)]
        if app_key:
            files.append((folder / APP_KEY_FILE, app_key))
        for path, text in files:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(text)
                if os.geteuid() == 0:
                    os.fchown(descriptor, user.pw_uid, user.pw_gid)
        if os.geteuid() == 0:
            os.chown(folder, user.pw_uid, user.pw_gid)
        return script_path

    def submission_environment(self, account: str, secrets: Mapping[str, str]) -> dict[str, str]:
        """The environment the submission command runs in as the account: the agent's minimal one, the
        account's own name and home, and the task's secrets, which the batch system passes on to the job
        (sbatch, qsub and bsub export the submitting environment). Secrets go nowhere else: not on a
        command line, not in the script, not to a privileged process. Names follow the one rule."""
        user = pwd.getpwnam(account)
        try:
            checked = task_environment.checked(secrets, "The task's secrets")
        except task_environment.NameRefused as error:
            raise Refused(f"The task's secrets cannot be passed on: {error}", permanent=True) from None
        return {
            **checked,
            **agent_environment(self.settings.path),
            "HOME": user.pw_dir,
            "USER": account,
            "LOGNAME": account,
            "SHELL": user.pw_shell,
        }

    async def _run(
        self,
        argv: Sequence[str],
        stdin: bytes | None = None,
        environment: Mapping[str, str] | None = None,
        account: str | None = None,
        output: BinaryIO | None = None,
        /,
    ) -> Completed:
        """A cluster command (the dialects' queries, signals, cancels): the agent's minimal environment
        unless one is given, as the agent itself unless an account is."""
        environment = environment or agent_environment(self.settings.path)
        return await self.run(argv, stdin, environment, account, output)

    async def start(self, assignment: dict[str, Any], report: Report) -> None:
        """Submit the task's job as the user's account, or raise Refused with the reason."""
        self._ensure_poller(report)
        task_id = str(assignment["task_id"])
        if self._job(task_id) is not None or task_id in self.unanswered:
            return  # a repeated assignment of a task whose job is already in the cluster (or may be)
        refuse_declared_volumes(assignment, self.name.upper())
        account = self.account_for(str(assignment.get("user") or ""))
        if not assignment.get("task_token"):
            raise Refused("The plane sent no task token; upgrade the control plane.", permanent=True)
        folder = self.settings.jobs_dir / task_id
        app = (assignment.get("spec") or {}).get("app")
        try:
            script, context = Scripts(self.name, self.settings, self.url).script(assignment, account, folder)
        except (Unsafe, TemplateInvalid) as error:
            raise Refused(f"The batch script was not made: {error}", permanent=True) from None
        self.settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.settings.jobs_dir.chmod(0o711)  # accounts reach their own task folder, and list nothing
        install_node_script(self.settings)
        app_key = new_key() if app is not None else ""
        script_path = self._prepare(folder, account, str(assignment["task_token"]), script, app_key)
        submit = self.dialect.submit(script_path, context)
        stdin = script.encode() if self.dialect.script_on_stdin else None
        environment = self.submission_environment(account, assignment.get("secrets") or {})
        recorded = Submission(
            task_id, str(folder), account, json.dumps(app) if app else "",
            str(assignment.get("lease_id") or ""), int(assignment.get("attempt") or 1),
        )  # fmt: skip
        try:
            output = self.submissions.begin(recorded)
        except OSError as error:  # a full disk: nothing is submitted, the task waits for another try
            raise Refused(f"This agent could not record the task's submission ({error}).") from None
        with output:
            submitted = await self.run(submit, stdin, environment, account, output)
        if submitted.returncode:
            self.submissions.end(task_id)
            message = submitted.message
            raise Refused(f"{submit[0]}: {message}", permanent=not TRANSIENT.search(message))
        try:
            job = self.dialect.job_id(submitted.stdout)
        except ValueError as error:
            self.submissions.end(task_id)
            raise Refused(str(error)) from None
        self.state.add_job(JobRecord(task_id, job, str(folder), account, app=recorded.app))
        logger.info("task %s is %s job %s of %s", task_id, self.name, job, account)
        await report(task_id, "status", {"state": "pending", "reason": "submitted", "job_id": job}, None)

    # Following ---------------------------------------------------------------------------------------

    def adopt(self, report: Report) -> list[str]:
        """Follow the jobs a previous agent process submitted, by their job ids: those in its state, and
        those of submissions it was killed in the middle of (agents.hpc.submissions), which are held under
        their leases until their commands' answers are read (_answered)."""
        self._ensure_poller(report)
        for found in self.submissions.found():
            task_id = found.submission.task_id
            if self._job(task_id) is not None:
                continue  # committed: the state has it
            if self.state.lease(task_id) != found.submission.lease_id:
                self.state.lease_begin(task_id, found.submission.lease_id, found.submission.attempt)
            self.unanswered[task_id] = found
        return self.running()

    async def _answered(self) -> None:
        """Each submission a killed agent left: its job followed once its command's answer names it; or,
        where no answer came within the command's time limit, forgotten with its lease (it was never
        submitted, or its submission failed: the plane, told nothing of it, offers the task again)."""
        for task_id, found in list(self.unanswered.items()):
            output = self.submissions.output(task_id)
            try:
                job = self.dialect.job_id(output)
            except ValueError:
                if time.time() < found.recorded_at + COMMAND_SECONDS:
                    continue  # the command may still be running, its agent gone
                del self.unanswered[task_id]
                self.stop_on_answer.discard(task_id)
                logger.warning("task %s: its submission was never answered; it is forgotten", task_id)
                self.submissions.end(task_id)
                if self.state.lease(task_id) == found.submission.lease_id:
                    self.state.lease_end(task_id)
                continue
            del self.unanswered[task_id]
            submission = found.submission
            self.state.add_job(
                JobRecord(task_id, job, submission.folder, submission.account, app=submission.app)
            )
            logger.info(
                "task %s is %s job %s of %s (taken back)", task_id, self.name, job, submission.account
            )
            if self.reporter is not None:
                body = {"state": "pending", "reason": "submitted", "job_id": job}
                await self.reporter(task_id, "status", body, None)
            if task_id in self.stop_on_answer:
                self.stop_on_answer.discard(task_id)
                await self.stop(task_id, 0.0)

    def _ensure_poller(self, report: Report) -> None:
        self.reporter = report
        if self.poller is None or self.poller.done():
            self.poller = asyncio.create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a surprise in one pass must not stop the following of every job
                logger.exception("polling %s failed", self.name)
            await asyncio.sleep(self.settings.poll_seconds)

    async def poll(self) -> None:
        """One batched look at the cluster: report what changed for each of Klique's jobs."""
        if self.unanswered:
            await self._answered()
        jobs = self.state.jobs()
        if not jobs or self.reporter is None:
            self.polled = {}
            return
        try:
            statuses = await self.dialect.statuses([job.job_id for job in jobs], self._run)
        except ClusterUnavailable as error:
            if str(error) != self.problem:
                logger.warning("the %s queue cannot be read: %s", self.name, error)
            self.problem = str(error)
            return
        self.problem = ""
        for job in jobs:
            status = statuses.get(job.job_id)
            if status is None:
                continue
            self.polled[job.task_id] = (job.job_id, status)
            seen = f"{status.state}|{status.reason}"
            if status.state == "ended":
                await self._ended(job, status)
            elif seen != job.last:
                body: dict[str, Any] = {
                    "state": status.state,
                    "job_id": job.job_id,
                    "cluster_state": status.raw,
                }
                if status.state == "pending":
                    body["reason"] = status.reason or status.raw.lower() or "pending"
                await self.reporter(job.task_id, "status", body, None)
                self.state.job_seen(job.task_id, seen)

    async def _ended(self, job: JobRecord, status: JobStatus) -> None:
        assert self.reporter is not None
        folder = Path(job.folder)
        try:  # what the task's command returned, as its node reporter saw it
            code: int | None = int(read_owned(folder / "exit-code", job.account) or "")
        except ValueError:
            # The reporter never finished (the job failed before it, or was killed): the cluster's
            # accounting says how it ended, and the job's output file says why.
            code = status.exit_code
            tail = (read_owned(folder / "output.log", job.account) or "").splitlines()[-OUTPUT_TAIL_LINES:]
            if tail:
                body = {"stream": "cluster", "lines": [f"{self.name}: {line}" for line in tail]}
                await self.reporter(job.task_id, "log", body, None)
        cluster = {
            "scheduler": self.name,
            "job_id": job.job_id,
            "state": status.raw,
            "elapsed_seconds": status.elapsed_seconds,
            "gpus": status.gpus,
            "account": job.account,
        }
        result: dict[str, Any] = {
            "exit_code": code,
            "stopped": job.stopping,
            "outputs": [],
            "cluster": cluster,
        }
        if reason := self.reasons.pop(job.task_id, ""):
            result["reason"] = reason
        await self.reporter(job.task_id, "result", result, None)
        self.submissions.end(job.task_id)  # before the state forgets the job
        self.state.remove_job(job.task_id)
        self.polled.pop(job.task_id, None)
        with contextlib.suppress(FileNotFoundError):
            (Path(job.folder) / "token").unlink()  # the token dies with the run anyway; leave nothing about

    # Apps --------------------------------------------------------------------------------------------

    app_ports_here = False  # an app's port is picked on its compute node, by the node reporter

    def spec_of(self, task_id: str) -> dict[str, Any]:
        """What the agent needs again of a run after a restart: an app's section; {} for other runs."""
        job = self._job(task_id)
        return {"app": json.loads(job.app)} if job is not None and job.app else {}

    def _job(self, task_id: str) -> JobRecord | None:
        return next((job for job in self.state.jobs() if job.task_id == task_id), None)

    async def app_upstream(self, task_id: str, app: AppSpec) -> NodeRelay | None:
        """The way to the app of a run once its job runs and its node reporter has opened the app's relay
        (agents.hpc.apps); None if the job ends first. The node is the cluster's word, the ports the job's."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None  # from when the job runs, as long as the app may take to start
        while (job := self._job(task_id)) is not None:
            _, status = self.polled.get(task_id, ("", None))
            if status is not None and status.state == "running" and status.host:
                folder = Path(job.folder)
                key = (read_owned(folder / APP_KEY_FILE, job.account) or "").strip()
                try:
                    found = ports(read_owned(folder / ADDRESS_FILE, job.account))
                except AddressInvalid as error:
                    await self.fail(task_id, f"the app's address in its folder cannot be used: {error}")
                    return None
                if found is not None and key:
                    return await NodeRelay(status.host, found[0], found[1], key).open()
                node = status.host
                if deadline is None:
                    deadline = loop.time() + app.startup_seconds
                    logger.info("task %s: its job runs on %s; waiting for its app's relay", task_id, node)
                elif loop.time() > deadline:
                    why = f"{ADDRESS_FILE} is not in its folder, or is not its account's"
                    await self.fail(
                        task_id,
                        f"the job runs on {node}, but its app's relay did not open within "
                        f"{app.startup_seconds} s ({why})",
                    )
                    return None
            await asyncio.sleep(APP_LOOK_SECONDS)
        return None

    async def fail(self, task_id: str, reason: str, grace_seconds: float = 10.0) -> None:
        """Stop a run for a reason outside its command (an app that never answered its health check): the
        reason, with the last lines of the job's output, goes into its result."""
        job = self._job(task_id)
        if job is None:
            return
        output = read_owned(Path(job.folder) / "output.log", job.account) or ""
        self.reasons[task_id] = with_log_end(reason, output)
        await self.stop(task_id, grace_seconds)

    # Stopping ----------------------------------------------------------------------------------------

    async def stop(self, task_id: str, grace_seconds: float) -> None:
        """SIGTERM through the cluster, then cancel after the grace period (at once for a waiting job)."""
        job = self._job(task_id)
        if job is None:
            if task_id in self.unanswered:
                self.stop_on_answer.add(task_id)  # its job, if the cluster took it, is cancelled then
            return
        self.state.job_stopping(task_id)
        waiting = job.last.startswith("pending") or not job.last
        if grace_seconds > 0 and not waiting:
            signalled = await self._run(self.dialect.signal(job.job_id))
            if signalled.returncode:
                logger.warning("signalling job %s: %s", job.job_id, signalled.message)
            deadline = asyncio.get_running_loop().time() + grace_seconds
            while asyncio.get_running_loop().time() < deadline:
                statuses = await self._quietly(job.job_id)
                if statuses is not None and statuses.state == "ended":
                    return
                await asyncio.sleep(1.0)
        cancelled = await self._run(self.dialect.cancel(job.job_id))
        if cancelled.returncode:
            logger.warning("cancelling job %s: %s", job.job_id, cancelled.message)

    async def _quietly(self, job_id: str) -> JobStatus | None:
        try:
            return (await self.dialect.statuses([job_id], self._run)).get(job_id)
        except ClusterUnavailable:
            return None

    async def stop_all(self, grace_seconds: float) -> None:
        """An agent that stops leaves its jobs to the cluster; the next agent finds them by job id."""
