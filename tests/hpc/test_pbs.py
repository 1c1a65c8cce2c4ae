"""The PBS backend against Slurm's PBS commands (slurm-wlm-torque's qsub, qstat and qdel over the same
single-node Slurm): no OpenPBS or Torque server exists in the registries this machine reaches."""

from __future__ import annotations

import asyncio
import pwd
import uuid
from pathlib import Path

import pytest

from tests.hpc.conftest import PlaneStandIn, Reports, assignment, make_backend, until

pytestmark = pytest.mark.usefixtures("slurm", "accounts")


def test_qsub_runs_the_task_as_its_account_and_qstat_follows_it_to_its_exit_code(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    backend, reports, task = make_backend("pbs", jobs_dir, plane, tmp_path), Reports(), str(uuid.uuid4())
    command = ["bash", "-c", "echo gpus=$CUDA_VISIBLE_DEVICES; id -un; exit 5"]

    async def scenario() -> None:
        await backend.start(assignment(task, command, gpus=2, user="bob"), reports)
        await until(lambda: reports.of(task, "result"))
        assert backend.poller is not None
        backend.poller.cancel()

    asyncio.run(scenario())
    lines = plane.lines(task)
    assert len(next(line for line in lines if line.startswith("gpus=")).split(",")) == 2, lines
    assert "kqbob" in lines
    assert (jobs_dir / task / "output.log").stat().st_uid == pwd.getpwnam("kqbob").pw_uid
    [result] = reports.of(task, "result")
    assert result["exit_code"] == 5  # the wrappers' qstat has no exit_status: the node reporter's file
    assert result["cluster"]["scheduler"] == "pbs"
    assert result["cluster"]["state"] in ("C", "gone")


def test_qdel_stops_a_running_job(jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path) -> None:
    backend, reports, task = make_backend("pbs", jobs_dir, plane, tmp_path), Reports(), str(uuid.uuid4())

    async def scenario() -> None:
        await backend.start(assignment(task, ["bash", "-c", "echo started; sleep 120"]), reports)
        await until(lambda: "started" in plane.lines(task))
        await backend.stop(task, 5)
        await until(lambda: reports.of(task, "result"))
        assert backend.poller is not None
        backend.poller.cancel()

    asyncio.run(scenario())
    assert reports.of(task, "result")[0]["stopped"] is True


def test_pbsnodes_gives_the_clusters_cpus_and_nodes(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    """Slurm's pbsnodes says np (the node's CPUs) and the PBS state, not the CPUs its jobs hold: idle
    reads as none in use, allocated as all, mixed as unknown (left out)."""
    import os
    import subprocess

    backend = make_backend("pbs", jobs_dir, plane, tmp_path)
    state = subprocess.run(
        ["sinfo", "--noheader", "--Node", "--format=%T"], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    found = asyncio.run(backend.capacity())
    cpus = len(os.sched_getaffinity(0))
    assert (found["cpus"], found["nodes"]) == (cpus, 1)
    expected = {"idle": 0, "allocated": cpus}.get(state.rstrip("*"))
    assert found.get("cpus_in_use") == expected, (state, found)
