"""An agent's word on a failure outside the task's own command (its image is not on the host, its program
could not start) travels in the result and becomes part of the task's reason, where the user reads it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from protocol.messages import MAX_RESULT_REASON, ProtocolError, Report, parse_from_agent
from tests.fleet.conftest import agent
from tests.fleet.test_fencing import receive, rows, run_of, start

REASON = "Its environment could not be built: the image localhost/trainer:2.1 is not on this host."


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        (REASON, "the image localhost/trainer:2.1 is not on this host"),
        ("two\nlines and\tcontrol\x1b[31m\u2028characters", "two lines and control [31m characters"),
    ],
)
def test_a_results_reason_is_the_tasks(fleet: dict[str, Any], sent: str, kept: str) -> None:
    async def scenario() -> dict[str, Any]:
        client = agent(fleet["token"].secret)
        (assign,) = await start(client)
        result = {"type": "result", **run_of(assign), "seq": 2, "exit_code": 97, "reason": sent}
        await client.send_json_to(result)
        ack = await receive(client, "ack")
        await client.disconnect()
        return ack

    assert asyncio.run(scenario())["verdict"] == "applied"
    task, task_runs, _ = rows(fleet["task"])
    assert "failed with exit code 97" in task.reason
    assert kept in task.reason, task.reason
    assert task.reason.isprintable()
    assert task_runs[-1].exit_code == 97


def test_a_result_without_a_reason_reads_as_before(fleet: dict[str, Any]) -> None:
    async def scenario() -> None:
        client = agent(fleet["token"].secret)
        (assign,) = await start(client)
        await client.send_json_to({"type": "result", **run_of(assign), "seq": 2, "exit_code": 3})
        await receive(client, "ack")
        await client.disconnect()

    asyncio.run(scenario())
    task, _, _ = rows(fleet["task"])
    assert "failed with exit code 3" in task.reason
    assert "(" not in task.reason


@pytest.mark.parametrize("reason", [7, None, ["a"], {"why": "x"}, "x" * (MAX_RESULT_REASON + 1)])
def test_a_reason_is_short_text(reason: object) -> None:
    message = {"type": "result", "task_id": "t", "lease_id": "0" * 32, "seq": 2, "exit_code": 1}
    with pytest.raises(ProtocolError, match="reason is text"):
        parse_from_agent({**message, "reason": reason})
    parsed = parse_from_agent(message)
    assert isinstance(parsed, Report)
    assert parsed.body["exit_code"] == 1
