"""The bare-metal backend: runs each task as a process group on free GPUs of this host.

GPUs come from NVML where the host has them, or from a configured count (tests, demos, hosts without a
GPU). Whole-GPU tasks get whole devices; a fractional task shares one device, with its share in
KLIQUE_GPU_MEMORY_FRACTION for frameworks that cap their memory.

Each task runs under `agents.runner` (forked by `agents.zygote`, which has the runner loaded: a fork costs
far less than a fresh interpreter), which writes its output and exit code to files in the task's folder,
so a task outlives a crash of its agent: the restarted agent adopts the runs recorded in its state
and reads each log on from where it stopped. A run's record is on disk before its runner is forked, with
the runner's pid noted by the zygote (agents.records): an agent killed before it committed a run it had
started leaves a runner its successor takes back by that pid.
Abort and preempt send SIGTERM to the whole process group, wait the grace period, then SIGKILL.

A task whose spec names an `image` runs in a container of the host's engine (agents.containers): the
runner starts it in the foreground, so everything above holds for it too, and the agent removes the
container if its runner was killed before the engine could.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agents import containers
from agents.backend import (
    MAX_REASON,
    Refused,
    Report,
    Upload,
    refuse_declared_volumes,
    upload_outputs,
    with_log_end,
)
from agents.records import FOLDER, Records
from agents.runner import reason_path
from agents.state import RunRecord, State
from agents.tunnel import Upstream
from protocol import environment as task_environment
from protocol import images
from protocol.apps import AppSpec
from protocol.units import UNITS_PER_GPU

MAX_LINE = 64 * 1024  # longer lines go out in pieces of this many characters, never dropped
POLL_SECONDS = 0.2

logger = logging.getLogger(__name__)

__all__ = ["BareMetal", "MigDevice", "Refused", "Report", "Upload", "detect_gpus", "split_lines"]


@dataclass(frozen=True)
class MigDevice:
    uuid: str  # what CUDA_VISIBLE_DEVICES takes for a MIG slice
    profile: str  # "1g.10gb"
    parent: int  # the physical GPU's index


def _mig_profile(name: str) -> str:
    """ "NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> "1g.10gb" """
    return name.rsplit(" ", 1)[-1].lower()


def detect_gpus() -> tuple[int, list[MigDevice]] | None:
    """The GPUs NVML sees and the MIG slices configured on them, or None where there is no NVIDIA driver.
    A GPU in MIG mode serves its slices only; its index is not handed out whole."""
    try:
        import pynvml  # noqa: PLC0415 -- optional: only hosts with NVIDIA's library have it
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        slices = []
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                current, _ = pynvml.nvmlDeviceGetMigMode(handle)
            except pynvml.NVMLError:  # a GPU without MIG
                continue
            if current != pynvml.NVML_DEVICE_MIG_ENABLE:
                continue
            for slot in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except pynvml.NVMLError:
                    continue
                uuid, name = pynvml.nvmlDeviceGetUUID(mig), pynvml.nvmlDeviceGetName(mig)
                slices.append(MigDevice(_text(uuid), _mig_profile(_text(name)), index))
        return count, slices
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _checked_variables(assignment: dict[str, Any]) -> dict[str, str]:
    """The task's variables and secrets, with its image, checked by the plane's own rules again: the agent
    trusts no one to have checked them. Refused (permanent) says what is wrong; nothing has started."""
    spec = assignment.get("spec") or {}
    try:
        variables = {
            **task_environment.checked(spec.get("environment")),
            **task_environment.checked(assignment.get("secrets") or {}, "The task's secrets"),
        }
    except task_environment.NameRefused as error:
        raise Refused(f"The task's environment cannot be set: {error}", permanent=True) from None
    if spec.get("image") not in (None, ""):
        try:  # a container engine must read it as an image and nothing else
            images.engine_reference(spec["image"])
        except images.ImageRefused as error:
            raise Refused(f"The task's image cannot be run here: {error}", permanent=True) from None
    return variables


def _reason(run: RunRecord) -> str:
    """What the run's runner said about a failure outside the task's own command, if anything."""
    try:
        return Path(reason_path(run.exit_path)).read_text()[:MAX_REASON].strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _log_end(path: Path) -> str:
    """The end of a log (its last 4 KiB only are read)."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 4096))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def split_lines(text: str) -> list[str]:
    """Lines of output, each cut into pieces of at most MAX_LINE characters."""
    pieces = []
    for line in text.split("\n"):
        pieces += [line[start : start + MAX_LINE] for start in range(0, max(len(line), 1), MAX_LINE)]
    return pieces


class Starter:
    """The agent's end of agents.zygote: started on first use, again if it died; one request at a time.

    The pipes are plain blocking files used from a worker thread (a fork answers within milliseconds), so
    the starter belongs to no event loop: an agent's backend outlives the loops of its sessions."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()

    async def start(self, request: dict[str, Any]) -> int:
        """Fork a runner for `request` (agents.zygote's fields); its pid, or OSError."""
        return await asyncio.to_thread(self._start, (json.dumps(request) + "\n").encode())

    def _start(self, line: bytes) -> int:
        with self.lock:
            for _ in range(2):  # a zygote that died (killed, out of memory) is replaced once
                process = self._process()
                assert process.stdin is not None
                assert process.stdout is not None
                try:
                    process.stdin.write(line)
                    process.stdin.flush()
                    reply = process.stdout.readline().decode().strip()
                except (OSError, ValueError):
                    reply = ""
                if reply.isdigit():
                    return int(reply)
                if reply.startswith("error"):
                    raise OSError(reply.removeprefix("error").strip())
                self._close(process)
            raise OSError("the runner starter (agents.zygote) exited without answering")

    def _process(self) -> subprocess.Popen[bytes]:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "agents.zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a signal to the agent's process group is not for it
            )
        return self.process

    def close(self) -> None:
        """Let the zygote go (it leaves when its stdin closes); the runners it forked keep running."""
        with self.lock:
            if self.process is not None:
                self._close(self.process)

    def _close(self, process: subprocess.Popen[bytes]) -> None:
        self.process = None
        for pipe in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class BareMetal:
    name = "baremetal"
    gpus: int
    work_dir: Path
    state: State
    source: str = "configured"
    shared_path: str = ""  # the shared file system, mounted at the same path into containers
    image_archives: str = ""  # a folder of image archives the administrator provides (agents.containers)
    upload: Upload | None = None
    problem: str = ""  # a host has nothing between the agent and its GPUs
    mig: list[MigDevice] = field(default_factory=list)
    used: dict[int, int] = field(default_factory=dict)  # device -> units in use
    starter: Starter = field(default_factory=Starter)
    stopping: set[str] = field(default_factory=set)
    followers: set[asyncio.Task[None]] = field(default_factory=set)  # kept so they are not collected mid-run
    records: Records = field(init=False)

    def __post_init__(self) -> None:
        self.records = Records(self.work_dir / FOLDER)

    def inventory(self) -> dict[str, Any]:
        slices = [
            {"uuid": device.uuid, "profile": device.profile, "gpu": device.parent} for device in self.mig
        ]
        return {"gpus": self.gpus, "source": self.source, "mig": slices}

    async def capacity(self) -> dict[str, int]:
        """This host's CPUs, and how many are busy: the last minute's load average, at most all of them."""
        cpus = os.cpu_count() or 1
        return {"cpus": cpus, "cpus_in_use": min(cpus, round(os.getloadavg()[0])), "nodes": 1}

    def _pick_mig(self, profile: str) -> str:
        """A free MIG slice of the profile asked for; its UUID goes into CUDA_VISIBLE_DEVICES."""
        taken = {device for run in self.state.runs() for device in run.mig}
        for device in self.mig:
            if device.profile == profile.lower() and device.uuid not in taken:
                return device.uuid
        raise Refused(f"No free MIG slice {profile} on this host.")

    def running(self) -> list[str]:
        return sorted(run.task_id for run in self.state.runs())

    def queue(self) -> list[dict[str, Any]]:
        return []  # no queue of its own: what runs is what `running` lists

    def _pick(self, units: int) -> list[int]:
        in_mig_mode = {device.parent for device in self.mig}  # those GPUs serve their slices only
        usable = [device for device in range(self.gpus) if device not in in_mig_mode]
        if units % UNITS_PER_GPU == 0:
            wanted = units // UNITS_PER_GPU
            free = [device for device in usable if not self.used.get(device)]
            if len(free) < wanted:
                raise Refused(f"{wanted} free GPUs are needed and this host has {len(free)}.")
            return free[:wanted]
        shared = [device for device in usable if self.used.get(device, 0) + units <= UNITS_PER_GPU]
        if not shared:
            raise Refused("No GPU on this host has room for this share.")
        # The fullest device that still fits keeps whole devices free for whole-GPU work.
        return [max(shared, key=lambda device: (self.used.get(device, 0), -device))]

    def _hold(self, devices: list[int], units: int, sign: int) -> None:
        share = units if units % UNITS_PER_GPU else UNITS_PER_GPU
        for device in devices:
            self.used[device] = max(0, self.used.get(device, 0) + sign * share)

    async def start(self, assignment: dict[str, Any], report: Report) -> None:
        """Start the task, or raise Refused. Output and the exit code go to `report` as they come."""
        command = (assignment.get("spec") or {}).get("command")
        if not command or not isinstance(command, list) or not all(isinstance(word, str) for word in command):
            raise Refused('The task has no command: its spec needs "command": ["program", "argument", ...].')
        refuse_declared_volumes(assignment, "bare-metal")
        task_id = assignment["task_id"]
        if self.state.run(task_id) is not None:
            return  # a repeated assignment of a task this agent already runs
        task_variables = _checked_variables(assignment)
        units = int(assignment["size_units"])
        mig: list[str] = []
        if assignment.get("sharing") == "mig" and self.mig:
            mig, devices = [self._pick_mig(str(assignment.get("mig_profile") or ""))], []
        else:
            devices = self._pick(units)
        directory = self.work_dir / task_id
        if directory.is_symlink() or directory.exists():  # an earlier run's folder: a new run starts empty
            shutil.rmtree(directory)  # does not follow symbolic links
        directory.mkdir(parents=True)
        environment = self._runner_environment(task_id, units, devices, mig)
        log_path, exit_path, spec_path = (
            directory / "output.log",
            directory / "exit-code",
            directory / "spec.json",
        )
        spec_path.write_text(json.dumps(assignment.get("spec") or {}))
        for stale in (exit_path, Path(reason_path(str(exit_path)))):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        outputs = [str(pattern) for pattern in (assignment.get("spec") or {}).get("outputs", [])]
        record = RunRecord(task_id, 0, str(log_path), str(exit_path), 0, devices, units, outputs, mig)
        try:
            slot = self.records.write(
                record, str(assignment.get("lease_id") or ""), int(assignment.get("attempt") or 1)
            )
        except OSError as error:  # a full disk: nothing is forked, the task waits for another try
            raise Refused(
                f"This host could not record the task's run ({error}); it is offered again."
            ) from None
        try:
            pid = await self.starter.start(
                {
                    "cwd": str(directory),
                    "env": environment,
                    "log": str(log_path),
                    "exit": str(exit_path),
                    "spec": str(spec_path),
                    "cache": str(self.work_dir / "environments"),
                    "command": command,
                    "variables": task_variables,
                    "record": str(slot),
                }
            )
        except OSError as error:
            self.records.clear(task_id)
            raise Refused(f"This host could not start the task's runner: {error}") from None
        self._hold(devices, units, +1)
        self.state.add_run(replace(record, pid=pid))
        await report(task_id, "status", {"state": "running", "devices": devices}, None)
        self._follow(task_id, report)

    def _runner_environment(
        self, task_id: str, units: int, devices: list[int], mig: list[str]
    ) -> dict[str, str]:
        """The runner is the agent's own program: its environment is the agent's and Klique's, never one a
        user influenced. The task's variables (secrets among them) reach only the task's command, through
        the runner's stdin: in memory, never on disk or on a command line."""
        environment = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": ",".join(mig or [str(device) for device in devices]),
            "KLIQUE_TASK_ID": task_id,
            "KLIQUE_GPU_SOURCE": self.source,  # a container is given devices only where they are real
            "PYTHONUNBUFFERED": "1",
        }
        if self.shared_path:
            environment["KLIQUE_SHARED_PATH"] = self.shared_path
        if self.image_archives:
            environment["KLIQUE_IMAGE_ARCHIVES"] = self.image_archives
        if units % UNITS_PER_GPU and not mig:
            environment["KLIQUE_GPU_MEMORY_FRACTION"] = f"{units / UNITS_PER_GPU:.4f}"
        return environment

    def adopt(self, report: Report) -> list[str]:
        """Take back the runs a previous agent process left; returns their task ids. Besides the runs in
        its state, those it forked a runner for and was killed before it committed: their records name
        them, and their runners' pids (_unrecorded)."""
        recovered = self._unrecorded()
        runs = self.state.runs()
        for run in runs:
            self._hold(run.devices, run.units, +1)
            self._follow(run.task_id, report, announce=run.task_id in recovered)
        return [run.task_id for run in runs]

    def _unrecorded(self) -> set[str]:
        """Put into the state the runs of records it lacks, where the zygote noted a runner's pid; forget
        the others, with their leases. Returns the task ids put in."""
        recovered: set[str] = set()
        for found in self.records.read():
            task_id = found.run.task_id
            if self.state.run(task_id) is not None:
                continue  # committed: the state has it (its record is emptied when it ends)
            if not found.forked:
                logger.warning("task %s: its runner was never started (its agent stopped first)", task_id)
                self.records.clear(task_id)
                if self.state.lease(task_id) == found.lease_id:
                    self.state.lease_end(task_id)
                continue
            if self.state.lease(task_id) != found.lease_id:
                self.state.lease_begin(task_id, found.lease_id, found.attempt)
            self.state.add_run(found.run)
            recovered.add(task_id)
        return recovered

    def _follow(self, task_id: str, report: Report, announce: bool = False) -> None:
        follower = asyncio.create_task(self._tail(task_id, report, announce))
        self.followers.add(follower)
        follower.add_done_callback(self.followers.discard)

    def _finished(self, run: RunRecord) -> int | None:
        """The exit code once the run has ended, else None."""
        try:
            return int(Path(run.exit_path).read_text())
        except (FileNotFoundError, ValueError):
            pass
        # Killed before it could write its exit code (the zygote reaps its runners as they end, so an ended
        # one does not linger as a zombie that answers signal 0).
        return None if _alive(run.pid) else -signal.SIGKILL

    async def _tail(self, task_id: str, report: Report, announce: bool = False) -> None:
        """Report the run's output as it comes, then its end. `announce`: first say it runs, for a run
        whose start was never reported (its agent was killed before it committed the report)."""
        if announce and (started := self.state.run(task_id)) is not None:
            await report(task_id, "status", {"state": "running", "devices": started.devices}, None)
        while True:
            run = self.state.run(task_id)
            if run is None:
                return
            code = self._finished(run)  # read before the log, so nothing written before the end is missed
            offset = run.offset
            try:
                with open(run.log_path, "rb") as log:
                    log.seek(offset)
                    data = log.read()
            except FileNotFoundError:
                data = b""
            complete = data if code is not None else data[: data.rfind(b"\n") + 1]
            if complete:
                text = complete.decode(errors="replace")
                await report(
                    task_id,
                    "log",
                    {"stream": "stdout", "lines": split_lines(text.removesuffix("\n"))},
                    offset + len(complete),
                )
            if code is not None:
                if code < 0:  # killed by a signal: an engine's client may have left its container running
                    await asyncio.to_thread(self._remove_container, run)
                uploaded, failed = await self._upload_outputs(run, report)
                self._hold(run.devices, run.units, -1)
                self.records.clear(task_id)  # before the state forgets the run
                self.state.remove_run(task_id)
                result: dict[str, Any] = {
                    "exit_code": code,
                    "stopped": task_id in self.stopping,
                    "outputs": uploaded,
                    "outputs_failed": failed,
                }
                if reason := _reason(run):
                    result["reason"] = reason
                await report(task_id, "result", result, None)
                self.stopping.discard(task_id)
                return
            await asyncio.sleep(POLL_SECONDS)

    async def _upload_outputs(self, run: RunRecord, report: Report) -> tuple[list[str], list[dict[str, str]]]:
        """The files in the run's folder on this host that match its declared outputs."""
        return await upload_outputs(Path(run.log_path).parent, run.task_id, run.outputs, self.upload, report)

    async def stop(self, task_id: str, grace_seconds: float) -> None:
        """SIGTERM the task's process group, then SIGKILL it after the grace period."""
        run = self.state.run(task_id)
        if run is None or self._finished(run) is not None:
            return
        self.stopping.add(task_id)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + grace_seconds
        while asyncio.get_running_loop().time() < deadline:
            if self._finished(run) is not None:
                return
            await asyncio.sleep(POLL_SECONDS / 2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # a container's engine client too: _tail removes the container

    app_ports_here = True  # an app's port is picked on this host, by the agent (agents.main)

    async def app_upstream(self, task_id: str, app: AppSpec) -> Upstream | None:
        """An app this host runs serves on its port here, from the process group of its run."""
        run = self.state.run(task_id)
        return Upstream(app.port, run.pid if run is not None else 0) if app.port is not None else None

    def spec_of(self, task_id: str) -> dict[str, Any]:
        """The spec a run of this host started with (an app's with its port chosen); {} if none."""
        try:
            spec = json.loads((self.work_dir / task_id / "spec.json").read_text())
        except (OSError, ValueError):
            return {}
        return spec if isinstance(spec, dict) else {}

    async def fail(self, task_id: str, reason: str, grace_seconds: float = 10.0) -> None:
        """Stop a run for a reason outside its command (an app that never answered its health check): the
        reason goes into its result, as a runner's own would."""
        run = self.state.run(task_id)
        if run is None:
            return
        with contextlib.suppress(OSError):
            Path(reason_path(run.exit_path)).write_text(with_log_end(reason, _log_end(Path(run.log_path))))
        await self.stop(task_id, grace_seconds)

    def _remove_container(self, run: RunRecord) -> None:
        """A run killed by a signal, in a container: make sure the container is gone with its runner (a
        runner killed with SIGKILL, by an abort's grace running out or by the kernel, leaves a container its
        engine still runs). A run that ended on its own needs nothing: `--rm` removed its container."""
        try:
            spec = json.loads((Path(run.log_path).parent / "spec.json").read_text())
        except (OSError, ValueError):
            return
        if isinstance(spec, dict) and spec.get("image") and (engine := containers.engine()) is not None:
            containers.remove(engine, run.task_id)

    async def stop_all(self, grace_seconds: float) -> None:
        await asyncio.gather(*(self.stop(task_id, grace_seconds) for task_id in self.running()))
