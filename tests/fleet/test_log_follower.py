"""A task's live log follower reads the store, with pub/sub only as a doorbell: it resumes from the
client's cursor, gets chunks whose live message was lost, and the end even if its message never came."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator
from django.db import connections
from django_tenants.utils import schema_context

from apps.fleet import log_follower
from apps.fleet.models import TaskReport
from apps.scheduling.models import Task, TaskState
from config.asgi import application
from tests.fleet.conftest import HOST, in_fleet


def follower(fleet: dict[str, Any], query: str = "") -> WebsocketCommunicator:
    return WebsocketCommunicator(
        application,
        f"/ws/v1/tasks/{fleet['task']}/logs/{query}",
        headers=[(b"host", HOST.encode()), (b"authorization", f"Bearer {fleet['admin_token']}".encode())],
    )


def quietly_stored(task_id: str, seq: int, line: str) -> int:
    """A log chunk kept in the store without its live message (as when Redis is down): its cursor."""
    with schema_context("fleet"):
        report = TaskReport.objects.create(task_id=task_id, seq=seq, kind="log", body={"lines": [line]})
    connections.close_all()
    return report.pk


def test_a_follower_resumes_from_its_cursor_and_sees_what_pub_sub_lost_and_the_end(
    fleet: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(log_follower, "LOG_POLL_SECONDS", 0.2)
    task_id = fleet["task"]
    first = quietly_stored(task_id, 1, "one")
    quietly_stored(task_id, 2, "two")
    quietly_stored(task_id, 3, "three")

    async def scenario() -> list[dict[str, Any]]:
        client = follower(fleet, f"?after={first}")
        assert (await client.connect())[0]
        received = [await client.receive_json_from(timeout=5) for _ in range(2)]
        await asyncio.to_thread(quietly_stored, task_id, 4, "four")
        received.append(await client.receive_json_from(timeout=5))
        await in_fleet(lambda: Task.objects.filter(pk=task_id).update(state=TaskState.COMPLETED))
        received.append(await client.receive_json_from(timeout=5))
        received.append(await client.receive_output(timeout=5))
        return received

    two, three, four, end, closed = asyncio.run(scenario())
    assert [chunk["lines"] for chunk in (two, three, four)] == [["two"], ["three"], ["four"]]
    assert two["cursor"] < three["cursor"] < four["cursor"]
    assert end == {"type": "end", "state": "completed", "cursor": four["cursor"]}
    assert closed["type"] == "websocket.close"

    async def again() -> list[dict[str, Any]]:  # a client that comes back with its cursor: only the end
        client = follower(fleet, f"?after={four['cursor']}")
        assert (await client.connect())[0]
        return [await client.receive_json_from(timeout=5)]

    assert asyncio.run(again()) == [end]


@pytest.mark.parametrize("query", ["?after=x", "?after=1e3"])
def test_a_cursor_that_is_not_a_number_is_refused_in_words(fleet: dict[str, Any], query: str) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        client = follower(fleet, query)
        assert (await client.connect())[0]
        return await client.receive_json_from(timeout=5), await client.receive_output(timeout=5)

    error, closed = asyncio.run(scenario())
    assert "after is the cursor of the last chunk read" in error["detail"]
    assert closed == {"type": "websocket.close", "code": 4400}
