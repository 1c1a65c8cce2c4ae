"""The Slurm backend against a real single-node Slurm with four fake GPUs (tests/hpc/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import pwd
import uuid
from pathlib import Path

import pytest

from agents.backend import Refused
from tests.hpc.conftest import PlaneStandIn, Reports, assignment, job_trace, make_backend, until

pytestmark = pytest.mark.usefixtures("slurm", "accounts")


def new_task() -> str:
    return str(uuid.uuid4())


def test_a_task_runs_as_its_users_account_on_its_gpus_and_its_exit_code_comes_from_sacct(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    backend, reports, task = make_backend("slurm", jobs_dir, plane, tmp_path), Reports(), new_task()
    command = ["bash", "-c", "echo gpus=$CUDA_VISIBLE_DEVICES; id -un; echo 42 > result.txt; exit 3"]

    async def scenario() -> None:
        await backend.start(assignment(task, command, gpus=2, spec={"outputs": ["result.txt"]}), reports)
        await until(lambda: reports.of(task, "result"))
        assert backend.poller is not None
        backend.poller.cancel()

    asyncio.run(scenario())
    lines = plane.lines(task)
    gpus = next(line for line in lines if line.startswith("gpus=")).removeprefix("gpus=")
    assert len(gpus.split(",")) == 2, lines  # two of the node's four devices
    assert "kqalice" in lines  # alice's Linux account
    output = jobs_dir / task / "output.log"
    assert output.stat().st_uid == pwd.getpwnam("kqalice").pw_uid  # written by Slurm as kqalice
    assert plane.outputs[f"{task}/result.txt"] == b"42\n"  # uploaded from the compute node
    assert plane.tokens == {f"Bearer kqt_{task}_signature"}  # with the task's own token
    [result] = reports.of(task, "result")
    assert result["exit_code"] == 3
    assert (result["cluster"]["state"], result["cluster"]["gpus"], result["cluster"]["account"]) == (
        "FAILED",
        "2",
        "kqalice",
    )
    assert isinstance(result["cluster"]["elapsed_seconds"], int)
    assert reports.of(task, "status")[0] == {
        "state": "pending",
        "reason": "submitted",
        "job_id": result["cluster"]["job_id"],
    }
    assert not (jobs_dir / task / "token").exists()  # the token goes with the run


def test_hostile_values_run_as_plain_data_or_are_refused(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    backend, reports, task = make_backend("slurm", jobs_dir, plane, tmp_path), Reports(), new_task()
    marker = jobs_dir / "pwned"
    values = [f"$(touch {marker})", f"`touch {marker}`", 'it\'s "quoted"', f"; touch {marker}"]
    hostile = assignment(
        task,
        ["printf", "%s\\n", *values, "${HOSTILE}"],
        name=f"$(touch {marker})",
        spec={"environment": {"HOSTILE": f"$(touch {marker})"}},
    )

    async def scenario() -> None:
        await backend.start(hostile, reports)
        await until(lambda: reports.of(task, "result"))
        with pytest.raises(Refused, match="newline") as refused:
            await backend.start(assignment(new_task(), ["echo", "x\n#SBATCH --uid=0"]), reports)
        assert refused.value.permanent
        assert backend.poller is not None
        backend.poller.cancel()

    asyncio.run(scenario())
    output = (jobs_dir / task / "output.log").read_text()
    assert plane.lines(task) == [*values, "${HOSTILE}"], output  # printed as given: nothing expanded or run
    assert reports.of(task, "result")[0]["exit_code"] == 0
    assert not marker.exists()


def test_a_waiting_job_shows_slurms_reason_and_cancel_and_preempt_stop_jobs(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    backend, reports = make_backend("slurm", jobs_dir, plane, tmp_path), Reports()
    big, small = new_task(), new_task()
    # Slurm signals every process of the step, the shell's children too: with `sleep 120 & wait` the
    # shell's wait could end on the killed sleep before its own TERM, leaving the trap unrun. In a loop
    # the shell runs on until its trap does.
    trap = "trap 'echo got TERM; exit 143' TERM; echo started; while :; do sleep 0.2 & wait; done"

    busy: dict[str, int] = {}

    async def scenario() -> None:
        await backend.start(assignment(big, ["bash", "-c", trap], gpus=4), reports)
        await until(lambda: "started" in plane.lines(big))
        busy.update(await backend.capacity())  # sinfo, while the job holds the node's GPUs
        await backend.start(assignment(small, ["echo", "never"], gpus=1), reports)
        await until(lambda: any(s.get("reason") == "Resources" for s in reports.of(small, "status")))
        await backend.stop(small, 0)  # cancel while it waits in Slurm
        await backend.stop(big, 10)  # preempt: SIGTERM, then cancel after the grace period
        await until(lambda: reports.of(small, "result") and reports.of(big, "result"))
        # The node reporter posts the job's last lines itself; they may reach the plane after the
        # agent reports the job's end (two senders), so wait for them rather than race them.
        await until(lambda: "got TERM" in plane.lines(big), seen=lambda: job_trace(plane, jobs_dir, big))
        assert backend.poller is not None
        backend.poller.cancel()

    asyncio.run(scenario())
    waiting = [s for s in reports.of(small, "status") if s["state"] == "pending"]
    assert waiting[-1]["reason"] == "Resources"  # Slurm's own reason, while the node is full
    assert reports.of(small, "result")[0]["stopped"] is True
    assert reports.of(small, "result")[0]["cluster"]["state"] == "CANCELLED"
    assert "got TERM" in plane.lines(big)  # the grace period let it stop cleanly
    preempted = reports.of(big, "result")[0]
    assert (preempted["stopped"], preempted["exit_code"]) == (True, 143)
    assert preempted["cluster"]["gpus"] == "4"
    assert preempted["cluster"]["elapsed_seconds"] is not None  # for metering, as the cluster counted it
    cpus = len(os.sched_getaffinity(0))  # single-node.sh gives the node CPUs=$(nproc)
    assert (busy["cpus"], busy["nodes"]) == (cpus, 1)
    assert 1 <= busy["cpus_in_use"] <= cpus  # the running job holds at least one of them


def test_a_restarted_agent_finds_its_running_job_by_job_id(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    task = new_task()
    first, reports = make_backend("slurm", jobs_dir, plane, tmp_path), Reports()

    async def before_the_crash() -> None:
        await first.start(assignment(task, ["bash", "-c", "echo one; sleep 4; echo two"]), reports)
        await until(lambda: any(s["state"] == "running" for s in reports.of(task, "status")))
        assert first.poller is not None
        first.poller.cancel()

    asyncio.run(before_the_crash())
    restarted, after = make_backend("slurm", jobs_dir, plane, tmp_path), Reports()

    async def after_the_restart() -> None:
        assert restarted.adopt(after) == [task]
        await until(lambda: after.of(task, "result"))
        assert restarted.poller is not None
        restarted.poller.cancel()

    asyncio.run(after_the_restart())
    assert after.of(task, "result")[0]["exit_code"] == 0
    assert plane.lines(task) == ["one", "two"]
    assert restarted.running() == []


def test_cluster_refusals_fail_the_task_and_a_controller_that_is_down_makes_it_wait(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path, slurm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, reports = make_backend("slurm", jobs_dir, plane, tmp_path), Reports()
    unreachable = jobs_dir / "unreachable.conf"  # the accounts read it too
    unreachable.write_text(slurm.read_text() + "SlurmctldPort=6999\nMessageTimeout=2\n")

    async def scenario() -> None:
        with pytest.raises(Refused, match="Invalid partition") as refused:
            await backend.start(
                assignment(new_task(), ["true"], spec={"batch": {"partition": "nosuch"}}), reports
            )
        assert refused.value.permanent
        with pytest.raises(Refused, match="mallory has no Linux account") as unmapped:
            await backend.start(assignment(new_task(), ["true"], user="mallory"), reports)
        assert unmapped.value.permanent

        # A job in the cluster, then the controller goes away: submissions wait, following pauses.
        task = new_task()
        await backend.start(assignment(task, ["bash", "-c", "sleep 3; echo finished"]), reports)
        os.environ["SLURM_CONF"] = str(unreachable)  # the agent's commands now find no controller
        with pytest.raises(Refused, match="Unable to contact slurm controller") as waiting:
            await backend.start(assignment(new_task(), ["true"]), reports)
        assert not waiting.value.permanent
        await backend.poll()
        assert "Unable to contact" in backend.problem
        assert backend.running() == [task]
        os.environ["SLURM_CONF"] = str(slurm)  # it comes back: the job is followed to its end
        await until(lambda: reports.of(task, "result"))
        assert backend.poller is not None
        backend.poller.cancel()
        assert reports.of(task, "result")[0]["exit_code"] == 0

    monkeypatch.setenv("SLURM_CONF", str(slurm))  # put back whatever happens
    asyncio.run(scenario())


def test_a_job_that_fails_before_its_command_ends_with_sacct_exit_code_and_slurms_message(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    backend = make_backend("slurm", jobs_dir, plane, tmp_path, node_python="/nonexistent/python3")
    reports, task = Reports(), new_task()

    async def scenario() -> None:
        await backend.start(assignment(task, ["true"]), reports)
        await until(lambda: reports.of(task, "result"))
        assert backend.poller is not None
        backend.poller.cancel()

    asyncio.run(scenario())
    [result] = reports.of(task, "result")
    assert (result["exit_code"], result["cluster"]["state"]) == (2, "FAILED")  # from sacct
    said = [line for log in reports.of(task, "log") for line in log["lines"]]
    assert any("/nonexistent/python3" in line and "No such file" in line for line in said), said


def test_a_secret_reaches_the_job_through_sbatchs_environment_and_only_the_job(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    """Submitted as kqalice with no privileged helper between the agent and sbatch: the job runs as the
    account and has its secret, which is neither in the script nor on a command line."""
    backend, reports, task = make_backend("slurm", jobs_dir, plane, tmp_path), Reports(), new_task()
    command = ["bash", "-c", 'id -un; echo "token=$HF_TOKEN"; echo "path=$PATH"']

    async def scenario() -> None:
        await backend.start(assignment(task, command, secrets={"HF_TOKEN": "hf_slurm_value"}), reports)
        await until(lambda: reports.of(task, "result"))
        assert backend.poller is not None
        backend.poller.cancel()

    asyncio.run(scenario())
    lines = plane.lines(task)
    assert "kqalice" in lines
    assert "token=hf_slurm_value" in lines
    assert "hf_slurm_value" not in (jobs_dir / task / "job.sh").read_text()
    assert reports.of(task, "result")[0]["exit_code"] == 0
