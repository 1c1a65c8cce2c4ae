"""The bare-metal backend: runs each task as a process group on free GPUs of this host.

GPUs come from NVML where the host has them, or from a configured count (tests, demos, hosts without a
GPU). Whole-GPU tasks get whole devices; a fractional task shares one device, with its share in
KLIQUE_GPU_MEMORY_FRACTION for frameworks that cap their memory. Abort and preempt send SIGTERM to the
whole process group, wait the grace period, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNITS_PER_GPU = 840  # the control plane's unit: 1/840 of a GPU

Report = Callable[[str, dict[str, Any]], Awaitable[None]]  # (kind, body) for one task


class Refused(Exception):
    """This host cannot run the task; the message goes back to the plane as the rejection's reason."""


def detect_gpus() -> int | None:
    """The number of GPUs NVML sees, or None where there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


@dataclass
class _Run:
    process: asyncio.subprocess.Process
    devices: list[int]
    units: int
    stopping: bool = False


@dataclass
class BareMetal:
    gpus: int
    work_dir: Path
    source: str = "configured"
    used: dict[int, int] = field(default_factory=dict)  # device -> units in use
    runs: dict[str, _Run] = field(default_factory=dict)
    followers: set[asyncio.Task[None]] = field(default_factory=set)  # kept so they are not collected mid-run

    def inventory(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "source": self.source}

    def running(self) -> list[str]:
        return sorted(self.runs)

    def _pick(self, units: int) -> list[int]:
        if units % UNITS_PER_GPU == 0:
            wanted = units // UNITS_PER_GPU
            free = [device for device in range(self.gpus) if not self.used.get(device)]
            if len(free) < wanted:
                raise Refused(f"{wanted} free GPUs are needed and this host has {len(free)}.")
            return free[:wanted]
        shared = [device for device in range(self.gpus) if self.used.get(device, 0) + units <= UNITS_PER_GPU]
        if not shared:
            raise Refused("No GPU on this host has room for this share.")
        # The fullest device that still fits keeps whole devices free for whole-GPU work.
        return [max(shared, key=lambda device: (self.used.get(device, 0), -device))]

    async def start(self, assignment: dict[str, Any], report: Report) -> None:
        """Start the task, or raise Refused. Output and the exit code go to `report` as they come."""
        command = (assignment.get("spec") or {}).get("command")
        if not command or not isinstance(command, list) or not all(isinstance(word, str) for word in command):
            raise Refused('The task has no command: its spec needs "command": ["program", "argument", ...].')
        units = int(assignment["size_units"])
        devices = self._pick(units)
        task_id = assignment["task_id"]
        directory = self.work_dir / task_id
        directory.mkdir(parents=True, exist_ok=True)
        environment = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": ",".join(str(device) for device in devices),
            "KLIQUE_TASK_ID": task_id,
            "PYTHONUNBUFFERED": "1",
        }
        if units % UNITS_PER_GPU:
            environment["KLIQUE_GPU_MEMORY_FRACTION"] = f"{units / UNITS_PER_GPU:.4f}"
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                cwd=directory,
                env=environment,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as error:
            raise Refused(f"Cannot start {command[0]!r}: {error.strerror}.") from None
        for device in devices:
            self.used[device] = self.used.get(device, 0) + units // max(len(devices), 1)
        self.runs[task_id] = _Run(process, devices, units)
        follower = asyncio.create_task(self._follow(task_id, report))
        self.followers.add(follower)
        follower.add_done_callback(self.followers.discard)

    async def _follow(self, task_id: str, report: Report) -> None:
        run = self.runs[task_id]
        await report("status", {"state": "running", "devices": run.devices})
        assert run.process.stdout is not None
        batch: list[str] = []
        while True:
            # Lines that come together go out together; a quiet quarter second sends what has come.
            try:
                line = await asyncio.wait_for(run.process.stdout.readline(), timeout=0.25 if batch else None)
            except TimeoutError:
                line = None
            if line:
                batch.append(line.decode(errors="replace").rstrip("\n"))
            if batch and (line is None or line == b"" or len(batch) >= 50):
                await report("log", {"stream": "stdout", "lines": batch})
                batch = []
            if line == b"":
                break
        code = await run.process.wait()
        for device in run.devices:
            self.used[device] = max(0, self.used.get(device, 0) - run.units // max(len(run.devices), 1))
        del self.runs[task_id]
        await report("result", {"exit_code": code, "stopped": run.stopping})

    async def stop(self, task_id: str, grace_seconds: float) -> None:
        """SIGTERM the task's process group, then SIGKILL it after the grace period."""
        run = self.runs.get(task_id)
        if run is None or run.process.returncode is not None:
            return
        run.stopping = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(run.process.wait(), timeout=grace_seconds)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.process.pid, signal.SIGKILL)

    async def stop_all(self, grace_seconds: float) -> None:
        await asyncio.gather(*(self.stop(task_id, grace_seconds) for task_id in list(self.runs)))
