"""LSF: bsub, bjobs and bkill, as the agent drives them."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.hpc.cluster import Capacity, ClusterUnavailable, Execute, JobStatus, exit_code_of, node_name
from protocol.scripts import submit_command


class Lsf:
    name = "lsf"
    script_on_stdin = True  # protocol.scripts.SCRIPT_ON_STDIN
    STATES = {"PEND": "pending", "PSUSP": "pending", "WAIT": "pending", "RUN": "running",
              "USUSP": "running", "SSUSP": "running", "PROV": "running", "DONE": "ended", "EXIT": "ended",
              "ZOMBI": "ended"}  # fmt: skip

    def submit(self, script: Path, request: dict[str, Any]) -> list[str]:
        return submit_command(self.name, script, request)

    def job_id(self, stdout: str) -> str:
        match = re.search(r"Job <(\d+)> is submitted", stdout)
        if not match:
            raise ValueError(f"bsub printed no job id: {stdout.strip()[:300]!r}")
        return match.group(1)

    async def statuses(self, job_ids: Sequence[str], run: Execute) -> dict[str, JobStatus]:
        fields = "jobid stat exit_code pend_reason run_time exec_host"
        shown = await run(["bjobs", "-a", "-json", "-o", fields, *job_ids], None, None)
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
                state = self.STATES.get(raw, "pending")
                # EXEC_HOST: "hostA" or "4*hostA:2*hostB": the first host's name
                first = str(record.get("EXEC_HOST") or "").split(":")[0].rpartition("*")[2]
                found[job] = JobStatus(
                    state,
                    raw,
                    str(record.get("PEND_REASON") or "").strip(),
                    exit_code=exit_code_of(code),
                    elapsed_seconds=int(seconds) if seconds.isdigit() else None,
                    host=node_name(first) if state == "running" else "",
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
