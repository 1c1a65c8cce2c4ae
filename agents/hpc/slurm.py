"""Slurm: sbatch, squeue and sacct, as the agent drives them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.hpc.cluster import Capacity, ClusterUnavailable, Execute, JobStatus, exit_code_of, node_name
from protocol.scripts import submit_command

UNSETTLED_LOOKS = 5  # polls a failed job's exit code may take to reach Slurm's accounting


class Slurm:
    name = "slurm"
    script_on_stdin = False
    PENDING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SUSPENDED"})
    RUNNING = frozenset({"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING"})
    FAILED = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"})

    def __init__(self) -> None:
        self._unsettled: dict[str, int] = {}  # job -> looks at a failure that sacct gave exit 0

    def submit(self, script: Path, request: dict[str, Any]) -> list[str]:
        return submit_command(self.name, script, request)

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
            ["squeue", "--noheader", "--states=all", f"--jobs={','.join(job_ids)}", "--format=%i|%T|%r|%B"],
            None,
            None,
        )
        if queue.returncode and "invalid job id" not in queue.message.lower():
            raise ClusterUnavailable(queue.message)
        for line in queue.stdout.splitlines():
            job, raw, reason, host = ([*line.split("|"), "", "", ""])[:4]
            if job.strip() in job_ids:
                state = self._word(raw)
                if state != "ended":  # the end, with its exit code, comes from accounting below
                    found[job.strip()] = JobStatus(
                        state,
                        raw.strip(),
                        "" if reason == "None" else reason,
                        host=node_name(host) if state == "running" else "",
                    )
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
                exit_code = exit_code_of(code)
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
                    exit_code=exit_code_of(fields.get("ExitCode", "")),
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
