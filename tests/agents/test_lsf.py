"""The LSF backend, against LSF's documented command outputs (no LSF server can run here; see
tests/agents/lsf_outputs/README.md): the command lines it runs, the script it sends, what it reads back."""

from __future__ import annotations

import asyncio
import os
import pwd
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from agents.backend import Refused
from agents.hpc import Batch, Completed, Lsf, Settings
from agents.state import Position, State

OUTPUTS = Path(__file__).parent / "lsf_outputs"
TASK = "6f1c9a0e-0000-4000-8000-000000000001"
ME = pwd.getpwuid(os.geteuid()).pw_name  # alice maps to the agent's own account: no runuser, no root


class Cluster:
    """Answers each command with the next scripted output, and keeps what it was asked."""

    def __init__(self, answers: dict[str, list[Completed]]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], bytes | None]] = []
        self.environments: list[Mapping[str, str] | None] = []

    async def __call__(
        self,
        argv: Sequence[str],
        stdin: bytes | None,
        environment: Mapping[str, str] | None,
        account: str | None = None,
        output: BinaryIO | None = None,
        /,
    ) -> Completed:
        self.calls.append((list(argv), stdin))
        self.environments.append(environment)
        queue = self.answers[argv[0]]
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if output is not None:  # a submission's answer goes to its file, as the real command's does
            output.write(answer.stdout.encode())
        return answer


def read(name: str) -> str:
    return (OUTPUTS / name).read_text()


def backend(tmp_path: Path, cluster: Cluster, **settings: Any) -> Batch:
    return Batch(
        Lsf(),
        Settings(jobs_dir=tmp_path / "jobs", user_map={"alice": ME}, poll_seconds=3600, **settings),
        State(tmp_path / "agent.sqlite"),
        "https://acme.klique.example",
        run=cluster,
    )


def assignment(user: str = "alice") -> dict[str, Any]:
    return {
        "task_id": TASK,
        "lease_id": "l-1",
        "name": "train",
        "size_units": 4 * 840,
        "nodes": 2,
        "user": user,
        "task_token": "kqt_x_y",
        "spec": {"command": ["python", "train.py"], "batch": {"partition": "gpu", "time_limit_minutes": 30}},
    }


class Reports:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    async def __call__(self, task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        self.sent.append((task_id, kind, body))


def test_a_task_goes_to_bsub_on_stdin_and_is_followed_to_its_exit_code(tmp_path: Path) -> None:
    cluster = Cluster(
        {
            "bsub": [Completed(0, read("bsub.out"), "")],
            "bjobs": [
                Completed(0, read("bjobs-pending.json"), ""),
                Completed(0, read("bjobs-running.json"), ""),
                Completed(0, read("bjobs-exit.json"), ""),
            ],
        }
    )
    lsf, reports = backend(tmp_path, cluster), Reports()

    async def scenario() -> None:
        await lsf.start({**assignment(), "secrets": {"HF_TOKEN": "hf_secret_value"}}, reports)
        for _ in range(3):
            await lsf.poll()
        assert lsf.poller is not None
        lsf.poller.cancel()

    asyncio.run(scenario())
    (argv, script), *polls = cluster.calls
    submitted_in = cluster.environments[0]
    assert submitted_in is not None
    assert submitted_in["HF_TOKEN"] == "hf_secret_value"  # bsub passes its environment on to the job
    assert "hf_secret_value" not in str(cluster.calls)  # never on a command line or in the script
    assert argv == ["bsub"]  # alice maps to the agent's own account: no runuser; the script on stdin
    assert script is not None
    lines = script.decode().splitlines()
    for directive in (
        "#BSUB -nnodes 2",
        '#BSUB -gpu "num=2:mode=exclusive_process"',
        "#BSUB -q gpu",
        "#BSUB -W 30",
    ):
        assert directive in lines
    assert [call[0][:4] for call in polls] == [["bjobs", "-a", "-json", "-o"]] * 3
    assert all(call[0][-1] == "4821" for call in polls)
    assert [(kind, body.get("state"), body.get("reason")) for _, kind, body in reports.sent] == [
        ("status", "pending", "submitted"),
        ("status", "pending", "Job's requirements for reserving resource (gpu) not satisfied: 2 hosts;"),
        ("status", "running", None),
        ("result", None, None),
    ]
    result = reports.sent[-1][2]
    assert result["exit_code"] == 3
    assert result["cluster"] == {
        "scheduler": "lsf",
        "job_id": "4821",
        "state": "EXIT",
        "elapsed_seconds": 73,
        "gpus": "",
        "account": ME,
    }
    assert lsf.running() == []  # followed to its end and forgotten
    assert not (tmp_path / "jobs" / TASK / "token").exists()


def test_bsub_refusals_fail_the_task_and_an_lsf_that_is_down_makes_it_wait(tmp_path: Path) -> None:
    refused = backend(tmp_path, Cluster({"bsub": [Completed(255, "", read("bsub-bad-queue.err"))]}))
    with pytest.raises(Refused, match="No such queue") as failure:
        asyncio.run(refused.start(assignment(), Reports()))
    assert failure.value.permanent

    down = backend(tmp_path, Cluster({"bsub": [Completed(255, "", read("bsub-down.err"))]}))
    with pytest.raises(Refused, match="LSF is down") as waiting:
        asyncio.run(down.start(assignment(), Reports()))
    assert not waiting.value.permanent
    assert down.running() == []


def test_an_unmapped_user_is_refused_before_anything_is_submitted(tmp_path: Path) -> None:
    cluster = Cluster({"bsub": [Completed(0, read("bsub.out"), "")]})
    with pytest.raises(
        Refused, match=r"User mallory has no Linux account .* \[agent.lsf.user_map\]"
    ) as refusal:
        asyncio.run(backend(tmp_path, cluster).start(assignment(user="mallory"), Reports()))
    assert refusal.value.permanent
    assert cluster.calls == []


def test_preemption_signals_then_kills_and_a_pending_job_is_killed_at_once(tmp_path: Path) -> None:
    cluster = Cluster(
        {
            "bsub": [Completed(0, read("bsub.out"), "")],
            "bjobs": [Completed(0, read("bjobs-running.json"), "")],
            "bkill": [Completed(0, "Job <4821> is being signaled\n", "")],
        }
    )
    lsf = backend(tmp_path, cluster)

    async def scenario() -> None:
        await lsf.start(assignment(), Reports())
        await lsf.poll()
        await lsf.stop(TASK, grace_seconds=1.5)
        assert lsf.poller is not None
        lsf.poller.cancel()

    asyncio.run(scenario())
    kills = [argv for argv, _ in cluster.calls if argv[0] == "bkill"]
    assert kills == [["bkill", "-s", "TERM", "4821"], ["bkill", "4821"]]
    assert lsf.state.jobs()[0].stopping


def test_bjobs_names_the_first_host_of_a_running_job_only() -> None:
    """Where an app's relay is: the first of EXEC_HOST's hosts ("2*gpu07:2*gpu08"), while the job runs."""

    async def look(name: str) -> str:
        cluster = Cluster({"bjobs": [Completed(0, read(name), "")]})
        return (await Lsf().statuses(["4821"], cluster))["4821"].host

    assert asyncio.run(look("bjobs-running.json")) == "gpu07"
    assert asyncio.run(look("bjobs-pending.json")) == ""
    assert asyncio.run(look("bjobs-exit.json")) == ""


def test_an_app_on_lsf_is_reached_at_the_host_bjobs_names(tmp_path: Path) -> None:
    """The way to an app in an LSF job: the node from EXEC_HOST, the ports its node reporter wrote, the
    key the agent made; nothing while the job waits."""
    from agents.relay import NodeRelay
    from protocol.apps import AppSpec

    cluster = Cluster(
        {
            "bsub": [Completed(0, read("bsub.out"), "")],
            "bjobs": [
                Completed(0, read("bjobs-pending.json"), ""),
                Completed(0, read("bjobs-running.json"), ""),
            ],
        }
    )
    lsf, reports = backend(tmp_path, cluster), Reports()
    app = {"instance": "0123abcd", "port": None, "health_path": "/", "startup_seconds": 60}
    given = {**assignment(), "nodes": 1, "spec": {"command": ["serve", "--port={port}"], "app": app}}

    async def scenario() -> NodeRelay | None:
        await lsf.start(given, reports)  # its poller's first look: pending
        looking = asyncio.ensure_future(lsf.app_upstream(TASK, AppSpec.parse(app)))
        await asyncio.sleep(0.3)
        assert not looking.done()  # a pending job has no node
        folder = tmp_path / "jobs" / TASK
        (folder / "app-address").write_text('{"relay": 40001, "app": 40000}')  # as the reporter writes it
        await lsf.poll()  # running on 2*gpu07:2*gpu08
        found = await asyncio.wait_for(looking, 10)
        assert lsf.poller is not None
        lsf.poller.cancel()
        return found

    found = asyncio.run(scenario())
    assert isinstance(found, NodeRelay)
    assert (found.host, found.relay_port, found.port) == ("gpu07", 40001, 40000)
    assert found.key == (tmp_path / "jobs" / TASK / "app-key").read_text()
    script = cluster.calls[0][1]
    assert script is not None
    assert b"--app-port auto --app-key-file" in script
