"""The HPC backends: Klique hands a task to Slurm, PBS or LSF as a batch job of the user's own account.

Klique never replaces the cluster's scheduler: the agent on a login node renders the task's batch script
(agents.batch), submits it with the cluster's own command as the Linux account the user maps to, and
follows the job with batched queries of the cluster's queue and accounting. The job's node reporter
(agents.node) sends output and outputs over HTTPS with the task's own token; this agent sends the job's
state as the cluster sees it (pending with the cluster's reason, running, ended with the exit code).

Nothing runs through a shell string: every command is an argument list, the script goes to the cluster
as a file or on stdin, and every value a task gives is checked or quoted by agents.batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import re
import shlex
import shutil
import stat
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import agents.node
from agents.backend import Refused, Report, Upload
from agents.batch import (
    DEFAULT_TEMPLATES,
    Quoted,
    TemplateInvalid,
    Unsafe,
    batch_request,
    exports,
    job_name,
    one_line,
    quote_command,
    render,
    render_isolated,
    safe,
)
from agents.state import JobRecord, State
from protocol import environment as task_environment
from protocol.units import UNITS_PER_GPU

logger = logging.getLogger("klique.agent.hpc")

COMMAND_SECONDS = 60.0
# Where the cluster's commands are looked up unless the configuration names other folders (`path`). The
# agent runs them by absolute path, in an environment it builds itself: never one a user influenced.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What the agent's own environment passes on to the cluster's commands (the operator's, not a user's).
PASSED_ON = re.compile(r"LANG|LC_[A-Z]+|TZ|SLURM_CONF|LSF_[A-Z_]+|PBS_[A-Z_]+|MODULEPATH")
# Submission errors that pass: the task waits and is placed again. Anything else is the cluster's "no".
TRANSIENT = re.compile(
    r"unable to contact|connection refused|socket timed out|timed out|temporarily|try again|"
    r"communication|not responding|is down|please wait|MaxSubmit|too many|resource busy",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def message(self) -> str:
        return (self.stderr.strip() or self.stdout.strip() or f"exit code {self.returncode}")[-2000:]


@dataclass(frozen=True)
class Capacity:
    """What a cluster has, as its own commands say: CPUs, those its jobs hold, and nodes."""

    cpus: int
    cpus_in_use: int | None  # None: some node does not say
    nodes: int

    @classmethod
    def of(cls, nodes: Iterable[tuple[int, int | None]]) -> Capacity:
        """From (CPUs, CPUs in use or None) per node."""
        counted = list(nodes)
        used = [in_use for _, in_use in counted]
        in_use = None if None in used else sum(value for value in used if value is not None)
        return cls(sum(total for total, _ in counted), in_use, len(counted))

    def as_dict(self) -> dict[str, int]:
        figures = {"cpus": self.cpus, "cpus_in_use": self.cpus_in_use, "nodes": self.nodes}
        return {key: value for key, value in figures.items() if value is not None}


def _count(value: object) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


class Execute(Protocol):
    """Runs a cluster command: an argument list, its stdin, the environment the agent built for it (None:
    the agent's minimal one) and the Linux account it runs as (None: the agent's own)."""

    def __call__(
        self,
        argv: Sequence[str],
        stdin: bytes | None,
        environment: Mapping[str, str] | None,
        account: str | None = None,
        /,
    ) -> Awaitable[Completed]: ...


def agent_environment(search_path: str = SYSTEM_PATH) -> dict[str, str]:
    """The environment of every cluster command: a fixed PATH and what the operator set for the cluster."""
    passed = {name: value for name, value in os.environ.items() if PASSED_ON.fullmatch(name)}
    return {**passed, "PATH": search_path}


def program(name: str, search_path: str) -> str | None:
    """The absolute path of a cluster command, found in the agent's own folders only."""
    if os.path.isabs(name):
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name, path=search_path)


def _switch_to(account: str | None) -> dict[str, Any]:
    """Popen's arguments that run the child as `account`: its user, group and groups are set in the forked
    child before exec, so no privileged program (runuser, su, sudo) ever sees the task's environment."""
    if account is None or os.geteuid() != 0:
        return {}
    user = pwd.getpwnam(account)
    if user.pw_uid == 0:
        return {}
    return {
        "user": user.pw_uid,
        "group": user.pw_gid,
        "extra_groups": os.getgrouplist(account, user.pw_gid),
    }


async def execute(
    argv: Sequence[str],
    stdin: bytes | None = None,
    environment: Mapping[str, str] | None = None,
    account: str | None = None,
    /,
) -> Completed:
    """Run a cluster command (an argument list, never a shell) by its absolute path, with a time limit."""
    environment = dict(environment) if environment is not None else agent_environment()
    found = program(argv[0], environment.get("PATH", SYSTEM_PATH))
    if found is None:
        return Completed(127, "", f"{argv[0]}: command not found on this host")
    try:
        process = await asyncio.create_subprocess_exec(
            found,
            *argv[1:],
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=environment,
            cwd="/",  # never the agent's folder, which the account cannot read
            **_switch_to(account),
        )
    except FileNotFoundError:
        return Completed(127, "", f"{argv[0]}: command not found on this host")
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin), COMMAND_SECONDS)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        return Completed(124, "", f"{argv[0]} did not answer within {COMMAND_SECONDS:.0f} s")
    return Completed(process.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))


class ClusterUnavailable(Exception):
    """The cluster's queue could not be read; the message is the cluster's own."""


OUTPUT_TAIL_LINES = 20


def read_owned(path: Path, account: str, *, last: int = 64 * 1024) -> str | None:
    """The end of a file in a task's folder, only if it is a plain file of the job's own account: the
    agent runs as root, and the folder is the user's, who could put a link to any file there."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as handle:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != pwd.getpwnam(account).pw_uid:
            return None
        handle.seek(max(0, status.st_size - last))
        return handle.read(last).decode(errors="replace")


@dataclass(frozen=True)
class JobStatus:
    state: str  # pending | running | ended
    raw: str = ""  # the cluster's own word for it
    reason: str = ""
    exit_code: int | None = None
    elapsed_seconds: int | None = None
    gpus: str = ""


UNSETTLED_LOOKS = 5  # polls a failed job's exit code may take to reach Slurm's accounting


def _exit_code(text: str) -> int | None:
    """Slurm's "code:signal" (and LSF's plain code): a signal reads as its negative, as for bare metal."""
    code, _, signal_ = text.partition(":")
    if not code.strip().lstrip("-").isdigit():
        return None
    if signal_.strip().isdigit() and int(signal_):
        return -int(signal_)
    return int(code)


class Slurm:
    name = "slurm"
    script_on_stdin = False
    PENDING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SUSPENDED"})
    RUNNING = frozenset({"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING"})
    FAILED = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"})

    def __init__(self) -> None:
        self._unsettled: dict[str, int] = {}  # job -> looks at a failure that sacct gave exit 0

    def submit(self, script: Path, request: dict[str, Any]) -> list[str]:
        return ["sbatch", "--parsable", str(script)]

    def job_id(self, stdout: str) -> str:
        job = stdout.strip().splitlines()[-1].split(";")[0] if stdout.strip() else ""
        if not job.isdigit():
            raise ValueError(f"sbatch printed no job id: {stdout.strip()[:200]!r}")
        return job

    def _word(self, raw: str) -> str:
        state = raw.split(maxsplit=1)[0] if raw.strip() else "UNKNOWN"
        if state in self.PENDING:
            return "pending"
        return "running" if state in self.RUNNING else "ended"

    async def statuses(self, job_ids: Sequence[str], run: Execute) -> dict[str, JobStatus]:
        found: dict[str, JobStatus] = {}
        queue = await run(
            ["squeue", "--noheader", "--states=all", f"--jobs={','.join(job_ids)}", "--format=%i|%T|%r"],
            None,
            None,
        )
        if queue.returncode and "invalid job id" not in queue.message.lower():
            raise ClusterUnavailable(queue.message)
        for line in queue.stdout.splitlines():
            job, raw, reason = ([*line.split("|"), "", ""])[:3]
            if job.strip() in job_ids:
                state = self._word(raw)
                if state != "ended":  # the end, with its exit code, comes from accounting below
                    found[job.strip()] = JobStatus(state, raw.strip(), "" if reason == "None" else reason)
        rest = [job for job in job_ids if job not in found]
        if rest:
            found.update(await self._accounting(rest, run))
        return found

    async def _accounting(self, job_ids: Sequence[str], run: Execute) -> dict[str, JobStatus]:
        history = await run(
            [
                "sacct", "--noheader", "--parsable2", f"--jobs={','.join(job_ids)}",
                "--format=JobIDRaw,State,ExitCode,ElapsedRaw,AllocTRES",
            ],
            None,
            None,
        )  # fmt: skip
        if history.returncode:
            return await self._controller(job_ids, run)  # no accounting storage: ask slurmctld
        found: dict[str, JobStatus] = {}
        for line in history.stdout.splitlines():
            job, raw, code, elapsed, tres = (line.split("|") + [""] * 5)[:5]
            if job in job_ids:
                gpus = next(
                    (item.split("=")[1] for item in tres.split(",") if item.startswith("gres/gpu=")), ""
                )
                exit_code = _exit_code(code)
                if raw.split()[:1] and raw.split()[0] in self.FAILED and exit_code == 0:
                    # slurmdbd can record the failure before its exit code: a failed job never reads as
                    # exit 0; look again next time, and after a few looks report the code as unknown.
                    seen = self._unsettled[job] = self._unsettled.get(job, 0) + 1
                    if seen <= UNSETTLED_LOOKS:
                        continue
                    exit_code = None
                self._unsettled.pop(job, None)
                found[job] = JobStatus(
                    self._word(raw),
                    raw.split()[0] if raw.strip() else "",
                    exit_code=exit_code,
                    elapsed_seconds=int(elapsed) if elapsed.isdigit() else None,
                    gpus=gpus,
                )
        return found

    async def _controller(self, job_ids: Sequence[str], run: Execute) -> dict[str, JobStatus]:
        found: dict[str, JobStatus] = {}
        for job in job_ids:
            shown = await run(["scontrol", "--oneliner", "show", "job", job], None, None)
            fields = dict(word.split("=", 1) for word in shown.stdout.split() if "=" in word)
            if fields.get("JobId") == job:
                found[job] = JobStatus(
                    self._word(fields.get("JobState", "")),
                    fields.get("JobState", ""),
                    exit_code=_exit_code(fields.get("ExitCode", "")),
                )
        return found

    def signal(self, job_id: str) -> list[str]:
        # The job's steps (the node reporters srun starts) get SIGTERM and pass it to the task; the batch
        # shell is left to end when they do, with their exit code.
        return ["scancel", "--signal=TERM", job_id]

    def cancel(self, job_id: str) -> list[str]:
        return ["scancel", job_id]

    async def capacity(self, run: Execute) -> Capacity | None:
        """CPUs and nodes from sinfo, one line per node and partition ("allocated/idle/other/total")."""
        shown = await run(["sinfo", "--noheader", "--Node", "--format=%N|%C"], None, None)
        if shown.returncode:
            raise ClusterUnavailable(shown.message)
        nodes: dict[str, tuple[int, int]] = {}
        for line in shown.stdout.splitlines():
            node, _, cpus = line.strip().partition("|")
            counts = cpus.split("/")
            if node and len(counts) == 4 and all(count.isdigit() for count in counts):
                nodes[node] = (int(counts[3]), int(counts[0]))  # a node in two partitions counts once
        return Capacity.of(nodes.values()) if nodes else None


class Pbs:
    """PBS and Torque (and Slurm's PBS wrappers from slurm-wlm-torque)."""

    name = "pbs"
    script_on_stdin = False
    STATES = {"Q": "pending", "H": "pending", "W": "pending", "T": "pending", "S": "pending", "R": "running",
              "E": "running", "B": "running", "C": "ended", "F": "ended", "X": "ended"}  # fmt: skip

    def submit(self, script: Path, request: dict[str, Any]) -> list[str]:
        """The size also goes on the command line: qsub options win over #PBS lines, and Slurm's PBS
        wrapper reads only its options. Every value here passed agents.batch.safe already."""
        resources = f"nodes={request['nodes']}:gpus={request['gpus_per_node']}"
        if request["time_limit_minutes"]:
            resources += f",walltime={request['time_limit_minutes']}:00"
        argv = ["qsub", "-N", request["job_name"], "-l", resources, "-o", request["output"], "-j", "oe"]
        if request["partition"]:
            argv += ["-q", request["partition"]]
        if request["account"]:
            argv += ["-A", request["account"]]
        return [*argv, str(script)]

    def job_id(self, stdout: str) -> str:
        job = stdout.strip().splitlines()[-1].strip() if stdout.strip() else ""
        if not re.fullmatch(r"\d+(\.[\w.-]+)?", job):
            raise ValueError(f"qsub printed no job id: {stdout.strip()[:300]!r}")
        return job

    async def statuses(self, job_ids: Sequence[str], run: Execute) -> dict[str, JobStatus]:
        shown = await run(["qstat", "-f", *job_ids], None, None)
        if shown.returncode and "unknown job" not in shown.message.lower():
            raise ClusterUnavailable(shown.message)
        found: dict[str, JobStatus] = {}
        for block in re.split(r"^Job Id:\s*", shown.stdout, flags=re.MULTILINE)[1:]:
            job = block.split(None, 1)[0]
            fields = {
                key.strip(): value.strip()
                for key, _, value in (line.partition("=") for line in block.splitlines()[1:])
                if value
            }
            raw = fields.get("job_state", "")
            code = fields.get("exit_status", fields.get("Exit_status", ""))
            match = job if job in job_ids else next((j for j in job_ids if j.split(".")[0] == job), None)
            if match:
                found[match] = JobStatus(
                    self.STATES.get(raw, "pending"),
                    raw,
                    fields.get("comment", ""),
                    exit_code=_exit_code(code),
                )
        for job in job_ids:  # gone from qstat: it ended; its exit code is in the task's folder
            found.setdefault(job, JobStatus("ended", "gone"))
        return found

    def signal(self, job_id: str) -> list[str]:
        return ["qdel", job_id]  # PBS sends SIGTERM, then SIGKILL after the server's kill_delay

    def cancel(self, job_id: str) -> list[str]:
        return ["qdel", job_id]

    async def capacity(self, run: Execute) -> Capacity | None:
        """CPUs and nodes from `pbsnodes -a`: blocks of "attribute = value" under each node's name.

        CPUs are resources_available.ncpus (PBS Professional, OpenPBS) or np (Torque, and Slurm's
        wrapper); those in use are resources_assigned.ncpus, or one per core in Torque's `jobs` list
        ("0-1/12.server,2/13.server"). Slurm's wrapper says neither: a node it calls mixed is unknown."""
        shown = await run(["pbsnodes", "-a"], None, None)
        if shown.returncode:
            raise ClusterUnavailable(shown.message)
        counted: list[tuple[int, int | None]] = []
        for block in re.split(r"\n\s*\n", shown.stdout.strip()):
            fields = {
                key.strip(): value.strip()
                for key, _, value in (line.partition("=") for line in block.splitlines()[1:])
                if value
            }
            total = _count(fields.get("resources_available.ncpus", fields.get("np", fields.get("pcpus"))))
            if total is not None:
                counted.append((total, self._in_use(fields, total)))
        return Capacity.of(counted) if counted else None

    @staticmethod
    def _in_use(fields: dict[str, str], total: int) -> int | None:
        if "resources_assigned.ncpus" in fields:
            return _count(fields["resources_assigned.ncpus"])
        if "jobs" in fields:
            cores = 0
            for piece in fields["jobs"].split(","):
                first, _, last = piece.split("/")[0].strip().partition("-")
                if first.isdigit():
                    cores += int(last) - int(first) + 1 if last.isdigit() else 1
            return cores
        state = fields.get("state", "")
        if "job-exclusive" in state or "busy" in state:
            return total
        return None if "slurmstate=mixed" in fields.get("status", "") else 0


class Lsf:
    name = "lsf"
    script_on_stdin = True  # bsub reads #BSUB lines only from a script on stdin
    STATES = {"PEND": "pending", "PSUSP": "pending", "WAIT": "pending", "RUN": "running",
              "USUSP": "running", "SSUSP": "running", "PROV": "running", "DONE": "ended", "EXIT": "ended",
              "ZOMBI": "ended"}  # fmt: skip

    def submit(self, script: Path, request: dict[str, Any]) -> list[str]:
        return ["bsub"]

    def job_id(self, stdout: str) -> str:
        match = re.search(r"Job <(\d+)> is submitted", stdout)
        if not match:
            raise ValueError(f"bsub printed no job id: {stdout.strip()[:300]!r}")
        return match.group(1)

    async def statuses(self, job_ids: Sequence[str], run: Execute) -> dict[str, JobStatus]:
        shown = await run(
            ["bjobs", "-a", "-json", "-o", "jobid stat exit_code pend_reason run_time", *job_ids], None, None
        )
        try:
            records = json.loads(shown.stdout or "{}").get("RECORDS", [])
        except json.JSONDecodeError:
            raise ClusterUnavailable(shown.message) from None
        if shown.returncode and not records:
            raise ClusterUnavailable(shown.message)
        found: dict[str, JobStatus] = {}
        for record in records:
            job, raw = str(record.get("JOBID", "")), str(record.get("STAT", ""))
            if job in job_ids and not record.get("ERROR"):
                code = str(record.get("EXIT_CODE") or ("0" if raw == "DONE" else ""))
                seconds = str(record.get("RUN_TIME", "")).split(" ")[0]
                found[job] = JobStatus(
                    self.STATES.get(raw, "pending"),
                    raw,
                    str(record.get("PEND_REASON") or "").strip(),
                    exit_code=_exit_code(code),
                    elapsed_seconds=int(seconds) if seconds.isdigit() else None,
                )
        return found

    def signal(self, job_id: str) -> list[str]:
        return ["bkill", "-s", "TERM", job_id]

    def cancel(self, job_id: str) -> list[str]:
        return ["bkill", job_id]

    async def capacity(self, run: Execute) -> Capacity | None:
        """Job slots (one per core unless the cluster says otherwise) and hosts from `bhosts -w`:
        HOST_NAME STATUS JL/U MAX NJOBS ..., where MAX is "-" for a host without a limit."""
        shown = await run(["bhosts", "-w"], None, None)
        if shown.returncode:
            raise ClusterUnavailable(shown.message)
        hosts = []
        for line in shown.stdout.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 5 and fields[3].isdigit() and fields[4].isdigit():
                hosts.append((int(fields[3]), int(fields[4])))
        return Capacity.of(hosts) if hosts else None


DIALECTS: dict[str, type[Slurm] | type[Pbs] | type[Lsf]] = {"slurm": Slurm, "pbs": Pbs, "lsf": Lsf}


@dataclass
class Settings:
    """`[agent.<scheduler>]` of the agent's configuration file (see docs/hpc.md)."""

    jobs_dir: Path
    user_map: dict[str, str] = field(default_factory=dict)
    default_account: str = ""  # the Linux account for users the map does not name; "" refuses them
    node_python: str = "python3"  # on the compute nodes
    report_url: str = ""  # the plane's address as compute nodes reach it
    allowed_roots: list[Path] = field(default_factory=list)
    container_runtime: str = "apptainer"  # apptainer, singularity or pyxis (Slurm)
    poll_seconds: float = 5.0
    path: str = SYSTEM_PATH  # the folders the cluster's commands are in (sbatch, qsub, bsub, ...)

    @classmethod
    def read(cls, config: Mapping[str, Any], scheduler: str, work_dir: Path) -> Settings:
        section = dict(config.get("agent", {}).get(scheduler, {}))
        jobs_dir = Path(section.pop("jobs_dir", work_dir / "jobs")).resolve()
        roots = [Path(root).resolve() for root in section.pop("allowed_roots", [])] or [jobs_dir]
        known = set(cls.__dataclass_fields__) - {"jobs_dir", "allowed_roots"}
        unknown = set(section) - known
        if unknown:
            raise ValueError(f"Unknown settings in [agent.{scheduler}]: {', '.join(sorted(unknown))}.")
        if section.get("container_runtime", "apptainer") not in ("apptainer", "singularity", "pyxis"):
            raise ValueError("container_runtime is one of apptainer, singularity, pyxis.")
        return cls(jobs_dir=jobs_dir, allowed_roots=roots, **section)


def node_script(settings: Settings) -> Path:
    """Where compute nodes find the node reporter: a copy in the jobs folder, which is on the cluster's
    shared file system, so compute nodes need no Klique installed."""
    return settings.jobs_dir / ".klique" / "node.py"


def install_node_script(settings: Settings) -> None:
    source = Path(agents.node.__file__).read_bytes()
    target = node_script(settings)
    if not target.exists() or target.read_bytes() != source:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.parent.chmod(0o755)
        temporary = target.with_suffix(".tmp")
        temporary.write_bytes(source)
        temporary.chmod(0o644)
        temporary.replace(target)


@dataclass(frozen=True)
class Scripts:
    """Renders a task's batch script for one scheduler: the agent before submitting, the plane for
    validation and previews."""

    scheduler: str
    settings: Settings
    url: str
    isolated: bool = False  # the plane renders what it is handed in a process of its own (render_isolated)

    def _inside_roots(self, path: str, what: str) -> str:
        resolved = Path(one_line(path, what)).resolve()
        if not any(resolved.is_relative_to(root) for root in self.settings.allowed_roots):
            roots = ", ".join(str(root) for root in self.settings.allowed_roots)
            raise Unsafe(f"{what} {path!r} is outside the folders this cluster allows ({roots}).")
        return str(resolved)

    def _run_line(self, spec: Mapping[str, Any], folder: Path, nodes: int, task_id: str) -> Quoted:
        command = quote_command(spec.get("command") or [])
        reporter = [
            self.settings.node_python, str(node_script(self.settings)),
            "--url", self.settings.report_url or self.url, "--task", task_id,
            "--token-file", str(folder / "token"), "--workdir", str(folder),
        ]  # fmt: skip
        code = spec.get("code") or {}
        if isinstance(code, Mapping) and code.get("path"):
            reporter += ["--chdir", self._inside_roots(str(code["path"]), "The code path")]
        for pattern in spec.get("outputs") or []:
            reporter += ["--output", one_line(pattern, "An output pattern")]
        image = spec.get("image")
        prefix: list[str] = []
        if image:
            image = str(image)
            if image.startswith("/") or image.endswith(".sif"):
                image = self._inside_roots(image, "The image")
            else:
                image = safe(image, "The image")
            runtime = self.settings.container_runtime
            if runtime == "pyxis" and self.scheduler == "slurm":
                steps = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", f"--container-image={image}"]
                return Quoted(
                    " ".join(shlex.quote(word) for word in [*reporter, "--", *steps]) + " " + command
                )
            prefix = [runtime if runtime != "pyxis" else "apptainer", "exec", "--nv", image]
        inner = " ".join(shlex.quote(word) for word in [*reporter, "--", *prefix]) + " " + command
        if self.scheduler == "slurm":  # one reporter per node, each reporting its own output
            return Quoted(f"srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 {inner}")
        return Quoted(inner)

    def script(self, assignment: Mapping[str, Any], account: str, folder: Path) -> tuple[str, dict[str, Any]]:
        """The job's batch script and the values it was rendered with, or Unsafe / TemplateInvalid."""
        spec = assignment.get("spec") or {}
        if not isinstance(spec, Mapping):
            raise Unsafe("The task's spec must be an object.")
        nodes = max(1, int(assignment.get("nodes") or 1))
        units = int(assignment["size_units"])
        if units % (UNITS_PER_GPU * nodes):
            raise Unsafe(
                f"{self.scheduler} pools take whole GPUs on each node; this task asks for "
                f"{units / UNITS_PER_GPU:g} GPUs on {nodes} node(s)."
            )
        batch = (assignment.get("batch") or {}).get(self.scheduler) or {}
        allowed = list(batch.get("allowed_directives") or [])
        request = batch_request(spec, allowed, batch.get("defaults") or {})
        task_id = str(assignment["task_id"])
        context = {
            "task_id": task_id,
            "job_name": job_name(task_id, str(assignment.get("name") or "")),
            "user": safe(account, "The account"),
            "nodes": nodes,
            "gpus_per_node": units // (UNITS_PER_GPU * nodes),
            "gpus": units // UNITS_PER_GPU,
            "gpu_type": request.gpu_type or str(assignment.get("mig_profile") or ""),
            "time_limit_minutes": request.time_limit_minutes,
            "partition": request.partition,
            "account": request.account,
            "directives": [Quoted(directive) for directive in request.directives],
            "workdir": safe(folder, "The jobs folder"),
            "output": safe(folder / "output.log", "The jobs folder"),
            "environment": exports(spec.get("environment") or {}),
            "run": self._run_line(spec, folder, nodes, task_id),
        }
        text = batch.get("template") or DEFAULT_TEMPLATES[self.scheduler]
        return (render_isolated if self.isolated else render)(text, context), context


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
        return sorted(job.task_id for job in self.state.jobs())

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

    def _prepare(self, folder: Path, account: str, token: str, script: str) -> Path:
        """A fresh folder for the task, owned by the account the job runs as: token (0600), script.

        Everything is written while the folder is still root's alone and handed over last, so the
        account can never swap a file for a link while the agent writes (a run before this one leaves
        its folder to the account: it is removed first, without following links)."""
        if folder.is_symlink() or folder.exists():
            shutil.rmtree(folder)  # rmtree does not follow symbolic links
        folder.mkdir(mode=0o700)
        user = pwd.getpwnam(account)
        script_path = folder / "job.sh"
        for path, text in ((folder / "token", token), (script_path, script)):
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
        /,
    ) -> Completed:
        """A cluster command (the dialects' queries, signals, cancels): the agent's minimal environment
        unless one is given, as the agent itself unless an account is."""
        return await self.run(argv, stdin, environment or agent_environment(self.settings.path), account)

    async def start(self, assignment: dict[str, Any], report: Report) -> None:
        """Submit the task's job as the user's account, or raise Refused with the reason."""
        self._ensure_poller(report)
        task_id = str(assignment["task_id"])
        if any(job.task_id == task_id for job in self.state.jobs()):
            return  # a repeated assignment of a task whose job is already in the cluster
        account = self.account_for(str(assignment.get("user") or ""))
        if not assignment.get("task_token"):
            raise Refused("The plane sent no task token; upgrade the control plane.", permanent=True)
        folder = self.settings.jobs_dir / task_id
        try:
            script, context = Scripts(self.name, self.settings, self.url).script(assignment, account, folder)
        except (Unsafe, TemplateInvalid) as error:
            raise Refused(f"The batch script was not made: {error}", permanent=True) from None
        self.settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.settings.jobs_dir.chmod(0o711)  # accounts reach their own task folder, and list nothing
        install_node_script(self.settings)
        script_path = self._prepare(folder, account, str(assignment["task_token"]), script)
        submit = self.dialect.submit(script_path, context)
        stdin = script.encode() if self.dialect.script_on_stdin else None
        environment = self.submission_environment(account, assignment.get("secrets") or {})
        submitted = await self.run(submit, stdin, environment, account)
        if submitted.returncode:
            message = submitted.message
            raise Refused(f"{submit[0]}: {message}", permanent=not TRANSIENT.search(message))
        try:
            job = self.dialect.job_id(submitted.stdout)
        except ValueError as error:
            raise Refused(str(error)) from None
        self.state.add_job(JobRecord(task_id, job, str(folder), account))
        logger.info("task %s is %s job %s of %s", task_id, self.name, job, account)
        await report(task_id, "status", {"state": "pending", "reason": "submitted", "job_id": job}, None)

    # Following ---------------------------------------------------------------------------------------

    def adopt(self, report: Report) -> list[str]:
        """Follow the jobs a previous agent process submitted, by their job ids."""
        self._ensure_poller(report)
        return self.running()

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
        await self.reporter(job.task_id, "result", result, None)
        self.state.remove_job(job.task_id)
        self.polled.pop(job.task_id, None)
        with contextlib.suppress(FileNotFoundError):
            (Path(job.folder) / "token").unlink()  # the token dies with the run anyway; leave nothing about

    # Stopping ----------------------------------------------------------------------------------------

    async def stop(self, task_id: str, grace_seconds: float) -> None:
        """SIGTERM through the cluster, then cancel after the grace period (at once for a waiting job)."""
        job = next((job for job in self.state.jobs() if job.task_id == task_id), None)
        if job is None:
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
