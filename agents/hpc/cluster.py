"""What the HPC backends share: running the cluster's commands as an argument list under the right account,
the agent's environment for them, reading a job's files as their owner, and the agent's settings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import re
import shutil
import signal
import stat
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import agents.node
from protocol.scripts import ScriptSettings, node_script

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


def count_of(value: object) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


class Execute(Protocol):
    """Runs a cluster command: an argument list, its stdin, the environment the agent built for it (None:
    the agent's minimal one), the Linux account it runs as (None: the agent's own) and where its output
    goes (None: a pipe; a file for a submission, whose answer must outlive the agent: agents.hpc.submissions).
    The output is in the Completed either way."""

    def __call__(
        self,
        argv: Sequence[str],
        stdin: bytes | None,
        environment: Mapping[str, str] | None,
        account: str | None = None,
        output: BinaryIO | None = None,
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
    output: BinaryIO | None = None,
    /,
) -> Completed:
    """Run a cluster command (an argument list, never a shell) by its absolute path, with a time limit;
    its output to `output` where given (a file, read back once the command has ended)."""
    environment = dict(environment) if environment is not None else agent_environment()
    found = program(argv[0], environment.get("PATH", SYSTEM_PATH))
    if found is None:
        return Completed(127, "", f"{argv[0]}: command not found on this host")
    try:
        process = await asyncio.create_subprocess_exec(
            found,
            *argv[1:],
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if output is None else output,
            stderr=asyncio.subprocess.PIPE,
            env=environment,
            cwd="/",  # never the agent's folder, which the account cannot read
            start_new_session=True,  # its own process group: a kill reaches the children it started
            **_switch_to(account),
        )
    except FileNotFoundError:
        return Completed(127, "", f"{argv[0]}: command not found on this host")
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin), COMMAND_SECONDS)
    except TimeoutError:
        await _end(process, 0)
        return Completed(124, "", f"{argv[0]} did not answer within {COMMAND_SECONDS:.0f} s")
    except asyncio.CancelledError:
        # The agent is stopping: a command already sent to the cluster (a submission, a cancel) is let
        # finish for a moment, so the cluster and the agent's state agree, and the child is reaped while
        # the event loop still runs, not collected after it has closed.
        await _end(process, CANCELLED_PATIENCE_SECONDS)
        raise
    if output is not None:
        out = os.pread(output.fileno(), MAX_OUTPUT, 0)
    return Completed(process.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))


MAX_OUTPUT = 1 << 20  # what is read back of a command's output file


CANCELLED_PATIENCE_SECONDS = 5.0


async def _end(process: asyncio.subprocess.Process, patience: float) -> None:
    """Wait up to `patience` seconds for a command, then kill it, and reap it either way."""
    try:
        await asyncio.wait_for(asyncio.shield(process.wait()), patience)
        return  # it ended, and its pipes closed
    except TimeoutError:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # the command and anything it left holding its pipes
    await process.wait()


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
    host: str = ""  # the node that runs the job's batch script (its first node), while it runs


NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


def node_name(text: str) -> str:
    """A host name as the cluster gave it, or "" if it is not one (Slurm's "n/a", "(null)", nothing)."""
    text = text.strip()
    return text if NODE_NAME.fullmatch(text) and text.lower() not in ("n/a", "none") else ""


@dataclass
class Settings(ScriptSettings):
    """`[agent.<scheduler>]` of the agent's configuration file (see docs/hpc.md): what its scripts need
    (protocol.scripts.ScriptSettings) and how the agent runs the cluster's commands."""

    user_map: dict[str, str] = field(default_factory=dict)
    default_account: str = ""  # the Linux account for users the map does not name; "" refuses them
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


def exit_code_of(text: str) -> int | None:
    """Slurm's "code:signal" (and LSF's plain code): a signal reads as its negative, as for bare metal."""
    code, _, signal_ = text.partition(":")
    if not code.strip().lstrip("-").isdigit():
        return None
    if signal_.strip().isdigit() and int(signal_):
        return -int(signal_)
    return int(code)
