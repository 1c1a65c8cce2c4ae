"""PBS and Torque: qsub, qstat and qdel, as the agent drives them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.hpc.cluster import (
    Capacity,
    ClusterUnavailable,
    Execute,
    JobStatus,
    count_of,
    exit_code_of,
    node_name,
)
from protocol.scripts import submit_command


class Pbs:
    """PBS and Torque (and Slurm's PBS wrappers from slurm-wlm-torque)."""

    name = "pbs"
    script_on_stdin = False
    STATES = {"Q": "pending", "H": "pending", "W": "pending", "T": "pending", "S": "pending", "R": "running",
              "E": "running", "B": "running", "C": "ended", "F": "ended", "X": "ended"}  # fmt: skip

    def submit(self, script: Path, request: dict[str, Any]) -> list[str]:
        return submit_command(self.name, script, request)

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
                state = self.STATES.get(raw, "pending")
                # exec_host: "node1/0+node1/1" (PBS Pro, Torque) or "node1/0*2": the first node's name
                first = re.split(r"[+/*]", fields.get("exec_host", ""), maxsplit=1)[0]
                found[match] = JobStatus(
                    state,
                    raw,
                    fields.get("comment", ""),
                    exit_code=exit_code_of(code),
                    host=node_name(first) if state == "running" else "",
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
            total = count_of(fields.get("resources_available.ncpus", fields.get("np", fields.get("pcpus"))))
            if total is not None:
                counted.append((total, self._in_use(fields, total)))
        return Capacity.of(counted) if counted else None

    @staticmethod
    def _in_use(fields: dict[str, str], total: int) -> int | None:
        if "resources_assigned.ncpus" in fields:
            return count_of(fields["resources_assigned.ncpus"])
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
