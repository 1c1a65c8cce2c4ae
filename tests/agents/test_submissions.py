"""An HPC agent killed in the middle of a submission (agents.hpc.submissions): the job the cluster took is
followed by the next agent, never submitted twice; a submission that never reached the cluster is
forgotten, and the plane offers its task again. LSF's bsub stands in for the three dialects: the record
and the answer's file are the backend's, not the dialect's."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import pytest

from agents.hpc.backend import Batch
from agents.hpc.cluster import Completed, execute
from tests.agents.test_lsf import TASK, Cluster, Reports, assignment, backend, read


class KilledWhileSubmitting(Cluster):
    """bsub with the agent killed as it ran: `answered` True, once bsub printed the job id (the agent
    never read it); False, while bsub is still on its way (it answers after the agent is gone)."""

    def __init__(self, answered: bool) -> None:
        super().__init__({"bsub": [Completed(0, read("bsub.out"), "")]})
        self.answered = answered
        self.left: BinaryIO | None = None

    async def __call__(
        self,
        argv: Sequence[str],
        stdin: bytes | None,
        environment: Mapping[str, str] | None,
        account: str | None = None,
        output: BinaryIO | None = None,
        /,
    ) -> Completed:
        if argv[0] != "bsub":
            return await super().__call__(argv, stdin, environment, account, output)
        self.calls.append((list(argv), stdin))
        if self.answered:
            assert output is not None
            output.write(read("bsub.out").encode())
            output.flush()
        raise asyncio.CancelledError  # the agent is gone here: nothing after this point runs


def killed_while_submitting(tmp_path: Path, answered: bool) -> None:
    """An agent that commits its state once per turn (here: never) is killed during the submission: what
    it left uncommitted (the task's lease) is lost, as a killed process's transaction is."""
    lsf = backend(tmp_path, KilledWhileSubmitting(answered))
    lsf.state.group_commits(lambda: None)
    lsf.state.lease_begin(TASK, "l-1", 2)

    async def scenario() -> None:
        with pytest.raises(asyncio.CancelledError):
            await lsf.start({**assignment(), "attempt": 2}, Reports())
        assert lsf.poller is not None
        lsf.poller.cancel()

    asyncio.run(scenario())
    lsf.state.rollback()
    lsf.state.db.close()


def next_agent(tmp_path: Path, cluster: Cluster) -> tuple[Batch, Reports]:
    lsf, reports = backend(tmp_path, cluster), Reports()
    return lsf, reports


def test_a_job_submitted_as_its_agent_was_killed_is_followed_by_the_next_and_not_submitted_again(
    tmp_path: Path,
) -> None:
    killed_while_submitting(tmp_path, answered=True)
    cluster = Cluster({"bjobs": [Completed(0, read("bjobs-running.json"), "")]})
    lsf, reports = next_agent(tmp_path, cluster)

    async def scenario() -> list[str]:
        held = lsf.adopt(reports)
        await lsf.poll()
        await lsf.start(assignment(), reports)  # the plane's offer again, had it been made: not a second job
        assert lsf.poller is not None
        lsf.poller.cancel()
        return held

    assert asyncio.run(scenario()) == [TASK]  # held at the hello, under its lease
    assert lsf.state.lease(TASK) == "l-1"
    assert [(job.task_id, job.job_id) for job in lsf.state.jobs()] == [(TASK, "4821")]
    assert [(kind, body.get("state"), body.get("job_id")) for _, kind, body in reports.sent] == [
        ("status", "pending", "4821"),  # the report the killed agent never sent
        ("status", "running", "4821"),
    ]
    assert [call[0][0] for call in cluster.calls] == ["bjobs"]  # no bsub


def test_a_submission_still_running_as_its_agent_was_killed_is_held_until_it_answers(tmp_path: Path) -> None:
    killed_while_submitting(tmp_path, answered=False)
    cluster = Cluster({"bjobs": [Completed(0, read("bjobs-pending.json"), "")]})
    lsf, reports = next_agent(tmp_path, cluster)

    async def scenario() -> None:
        assert lsf.adopt(reports) == [TASK]
        await lsf.poll()
        assert (lsf.running(), lsf.state.jobs(), reports.sent) == ([TASK], [], [])  # held, no answer yet
        await lsf.start(assignment(), reports)  # offered again meanwhile: not submitted a second time
        assert "bsub" not in [call[0][0] for call in cluster.calls]
        (tmp_path / "submissions" / f"{TASK}.out").write_text(read("bsub.out"))  # bsub answers now
        await lsf.poll()
        assert lsf.poller is not None
        lsf.poller.cancel()

    asyncio.run(scenario())
    assert [(job.task_id, job.job_id) for job in lsf.state.jobs()] == [(TASK, "4821")]
    assert reports.sent[0][1:] == ("status", {"state": "pending", "reason": "submitted", "job_id": "4821"})


@pytest.mark.parametrize("record", ["whole", "cut short"])
def test_a_submission_that_never_answered_is_forgotten_with_its_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record: str
) -> None:
    """No job id within the command's time limit: it never reached the cluster, or was refused. The next
    agent holds nothing of it (the plane offers the task again) and its files go. A record cut short by
    the kill means the command never ran."""
    monkeypatch.setattr("agents.hpc.backend.COMMAND_SECONDS", 0.0)
    killed_while_submitting(tmp_path, answered=False)
    written = tmp_path / "submissions" / f"{TASK}.json"
    if record == "cut short":
        written.write_text(written.read_text()[:30])
    lsf, reports = next_agent(tmp_path, Cluster({"bjobs": [Completed(0, "", "")]}))

    async def scenario() -> None:
        lsf.adopt(reports)
        await lsf.poll()
        assert lsf.poller is not None
        lsf.poller.cancel()

    asyncio.run(scenario())
    assert (lsf.running(), lsf.state.jobs(), lsf.state.lease(TASK), reports.sent) == ([], [], "", [])
    assert list((tmp_path / "submissions").iterdir()) == []


def test_the_record_goes_when_the_job_ends_or_the_submission_is_refused(tmp_path: Path) -> None:
    cluster = Cluster(
        {
            "bsub": [Completed(0, read("bsub.out"), ""), Completed(255, "", read("bsub-bad-queue.err"))],
            "bjobs": [Completed(0, read("bjobs-exit.json"), "")],
        }
    )
    lsf, reports = backend(tmp_path, cluster), Reports()
    submissions = tmp_path / "submissions"

    async def scenario() -> None:
        await lsf.start(assignment(), reports)
        assert sorted(path.name for path in submissions.iterdir()) == [f"{TASK}.json", f"{TASK}.out"]
        assert oct(submissions.stat().st_mode & 0o777) == "0o700"  # the agent's own: no account reaches it
        await lsf.poll()  # the job's end is reported
        assert list(submissions.iterdir()) == []
        with pytest.raises(Exception, match="bsub"):
            await lsf.start(assignment(), reports)
        assert list(submissions.iterdir()) == []
        assert lsf.poller is not None
        lsf.poller.cancel()

    asyncio.run(scenario())
    assert reports.sent[-1][1] == "result"


def test_a_submission_command_answers_into_its_file_even_after_its_caller_is_gone(tmp_path: Path) -> None:
    """The real runner of cluster commands: with a file for its output, the command writes its answer
    there (and the caller reads it back), also where the caller stopped waiting before the answer came."""

    async def scenario() -> tuple[Completed, str]:
        with open(tmp_path / "answered", "w+b") as output:
            answered = await execute(["sh", "-c", "echo 4242"], None, None, None, output)
        with open(tmp_path / "late", "w+b") as output:
            waiting = asyncio.create_task(
                execute(["sh", "-c", "sleep 0.3; echo 4243"], None, None, None, output)
            )
            await asyncio.sleep(0.1)
            waiting.cancel()  # the agent stops waiting; the command goes on
            with pytest.raises(asyncio.CancelledError):
                await waiting
        return answered, (tmp_path / "late").read_text()

    answered, late = asyncio.run(scenario())
    assert (answered.returncode, answered.stdout) == (0, "4242\n")
    assert (tmp_path / "answered").read_text() == "4242\n"
    assert late == "4243\n"


def test_a_stop_asked_while_the_answer_is_awaited_cancels_the_job_once_it_is_known(tmp_path: Path) -> None:
    killed_while_submitting(tmp_path, answered=False)
    cluster = Cluster(
        {"bjobs": [Completed(0, read("bjobs-pending.json"), "")], "bkill": [Completed(0, "", "")]}
    )
    lsf, reports = next_agent(tmp_path, cluster)

    async def scenario() -> None:
        lsf.adopt(reports)
        await lsf.stop(TASK, grace_seconds=30)  # the plane aborts the task before the answer is read
        assert cluster.calls == []
        (tmp_path / "submissions" / f"{TASK}.out").write_text(read("bsub.out"))
        await lsf.poll()
        assert lsf.poller is not None
        lsf.poller.cancel()

    asyncio.run(scenario())
    assert [call[0] for call in cluster.calls][:1] == [["bkill", "4821"]]  # cancelled at once: it waited
    assert lsf.state.jobs()[0].stopping  # its end is reported as stopped
