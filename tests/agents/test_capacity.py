"""What agents say of their environment's CPUs and nodes, read from each scheduler's own command in the
formats its documentation gives (Slurm's and Slurm's PBS wrapper are also read live in tests/hpc), and
from the host itself for bare metal."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import pytest

from agents.baremetal import BareMetal
from agents.hpc import DIALECTS, Batch, Completed, Settings
from agents.state import State

# `sinfo --noheader --Node --format=%N|%C`: a node in two partitions is listed twice.
SINFO = "gpu-01|8/24/0/32\ngpu-01|8/24/0/32\ngpu-02|32/0/0/32\ncpu-01|0/0/64/64\n"

# `pbsnodes -a` of OpenPBS (resources_available / resources_assigned) ...
OPENPBS = """node01
     Mom = node01.example.com
     ntype = PBS
     state = free
     pcpus = 32
     jobs = 1001.server/0, 1001.server/1
     resources_available.host = node01
     resources_available.ncpus = 32
     resources_assigned.mem = 8388608kb
     resources_assigned.ncpus = 2
     sharing = default_shared

node02
     Mom = node02.example.com
     ntype = PBS
     state = free
     pcpus = 32
     resources_available.ncpus = 32
     resources_assigned.ncpus = 0
"""

# ... and of Torque (np, and one core per entry of jobs, as ranges "first-last/job").
TORQUE = """node02
     state = job-exclusive
     power_state = Running
     np = 4
     ntype = cluster
     jobs = 0-3/201.server
     status = rectime=1796066916,state=free,ncpus=4

node03
     state = free
     np = 8
     ntype = cluster
     jobs = 0/202.server, 1-2/203.server

node04
     state = free
     np = 8
     ntype = cluster
"""

# `bhosts -w`: MAX job slots (one per core by default) and NJOBS; "-" where a host has no limit.
BHOSTS = """HOST_NAME          STATUS       JL/U    MAX  NJOBS    RUN  SSUSP  USUSP    RSV
hostA              ok              -     32      8      8      0      0      0
hostB              closed_Full     -     16     16     16      0      0      0
hostC              unavail         -      -      0      0      0      0      0
"""


def cluster(scheduler: str, answer: Completed, tmp_path: Path) -> tuple[Batch, list[list[str]]]:
    asked: list[list[str]] = []

    async def run(
        argv: Sequence[str],
        stdin: bytes | None,
        environment: Mapping[str, str] | None,
        account: str | None = None,
        output: BinaryIO | None = None,
        /,
    ) -> Completed:
        asked.append(list(argv))
        return answer

    backend = Batch(
        DIALECTS[scheduler](),
        Settings(jobs_dir=tmp_path / "jobs"),
        State(tmp_path / "agent.sqlite"),
        "https://acme.klique.example",
        run=run,
    )
    return backend, asked


@pytest.mark.parametrize(
    ("scheduler", "printed", "command", "expected"),
    [
        ("slurm", SINFO, ["sinfo", "--noheader", "--Node", "--format=%N|%C"], (128, 40, 3)),
        ("pbs", OPENPBS, ["pbsnodes", "-a"], (64, 2, 2)),
        ("pbs", TORQUE, ["pbsnodes", "-a"], (20, 7, 3)),
        ("lsf", BHOSTS, ["bhosts", "-w"], (48, 24, 2)),
    ],
)
def test_each_scheduler_says_its_cpus_those_in_use_and_its_nodes(
    scheduler: str, printed: str, command: list[str], expected: tuple[int, int, int], tmp_path: Path
) -> None:
    backend, asked = cluster(scheduler, Completed(0, printed, ""), tmp_path)
    found = asyncio.run(backend.capacity())
    assert (found["cpus"], found["cpus_in_use"], found["nodes"]) == expected
    assert asked == [command]


def test_a_node_slurms_pbs_wrapper_calls_mixed_leaves_cpus_in_use_unknown(tmp_path: Path) -> None:
    mixed = "localhost\n    state = free\n    np = 2\n    status = state=free,slurmstate=mixed,ncpus=2\n"
    backend, _ = cluster("pbs", Completed(0, mixed, ""), tmp_path)
    assert asyncio.run(backend.capacity()) == {"cpus": 2, "nodes": 1}


def test_a_cluster_that_cannot_answer_reports_nothing_rather_than_zero(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    down = Completed(1, "", "slurm_load_partitions: Unable to contact slurm controller (connect failure)")
    backend, _ = cluster("slurm", down, tmp_path)
    assert asyncio.run(backend.capacity()) == {}
    assert "Unable to contact slurm controller" in caplog.text


def test_a_bare_metal_host_reports_its_cpus_and_its_load(tmp_path: Path) -> None:
    host = BareMetal(2, tmp_path / "work", State(tmp_path / "agent.sqlite"))
    found = asyncio.run(host.capacity())
    assert (found["cpus"], found["nodes"]) == (os.cpu_count(), 1)
    load = os.getloadavg()[0]  # the last minute's: it moves slowly between the two reads
    assert abs(found["cpus_in_use"] - min(found["cpus"], load)) <= 1
