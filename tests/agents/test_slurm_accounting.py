"""A failed Slurm job never reads as exit code 0: slurmdbd may record the failure before its exit code,
so the agent looks again, and after a few looks reports the code as unknown (a failure all the same)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agents.hpc import UNSETTLED_LOOKS, Completed, Slurm


def accounting(*answers: str) -> list[dict[str, int | None]]:
    """What each look at job 17 finds when sacct answers these lines in turn."""
    slurm, replies = Slurm(), list(answers)

    async def run(argv: Sequence[str], *_: object) -> Completed:
        return Completed(0, replies.pop(0), "")

    async def looks() -> list[dict[str, int | None]]:
        found = []
        for _ in answers:
            statuses = await slurm._accounting(["17"], run)
            found.append({job: status.exit_code for job, status in statuses.items()})
        return found

    return asyncio.run(looks())


def test_a_failure_recorded_before_its_exit_code_waits_for_the_code() -> None:
    found = accounting("17|FAILED|0:0|3|", "17|FAILED|0:0|3|", "17|FAILED|2:0|3|")
    assert found == [{}, {}, {"17": 2}]


def test_a_failure_whose_code_never_comes_ends_with_an_unknown_code_never_0() -> None:
    found = accounting(*["17|NODE_FAIL|0:0|3|"] * (UNSETTLED_LOOKS + 1))
    assert found == [{}] * UNSETTLED_LOOKS + [{"17": None}]


def test_a_completed_job_and_a_signalled_one_read_at_once() -> None:
    assert accounting("17|COMPLETED|0:0|3|") == [{"17": 0}]
    assert accounting("17|CANCELLED by 0|0:15|3|") == [{"17": -15}]
