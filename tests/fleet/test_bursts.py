"""An agent's messages are taken off its socket at once and applied in bursts: what it sent while the
database thread was busy is applied in one transaction (again with each message in a savepoint of its own
where one is refused), and answered in the order it was sent.

Channels' consumers made a trip through the database thread before each message they dispatched, so a
message waited for all the database work queued before it and arrived alone; one agent's reports then
waited seconds behind each other in a drain."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any
from unittest import mock

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.fleet import dispatch
from apps.fleet.consumers import AgentConsumer
from apps.fleet.errors import AgentRejected
from apps.fleet.models import TaskReport
from apps.metering.models import LedgerEvent
from apps.scheduling import wake
from apps.scheduling.models import Task, TaskState
from apps.scheduling.services import TaskRequest, tasks_submit
from tests.fleet.conftest import agent
from tests.fleet.test_fencing import hello, receive, run_of, second_task


async def assigned(fleet: dict[str, Any], count: int = 1) -> tuple[Any, list[dict[str, Any]]]:
    """An agent connected, welcomed and given `count` assignments."""
    client = agent(fleet["token"].secret)
    assert (await client.connect())[0]
    await client.send_json_to(hello())
    await receive(client, "welcome")
    return client, [await receive(client, "assign") for _ in range(count)]


async def sent_while_busy(client: Any, sent: list[dict[str, Any]]) -> None:
    """Send the messages while the database thread is held (as a long burst or another agent's work would
    hold it), wait, and let it go."""
    release = threading.Event()
    held = asyncio.ensure_future(sync_to_async(release.wait)())
    await asyncio.sleep(0.1)
    for message in sent:
        await client.send_json_to(message)
    await asyncio.sleep(0.3)  # taken off the socket meanwhile, though the database thread is held
    release.set()
    await held


def burst_sizes() -> tuple[list[int], Any]:
    """Record the size of each burst the consumer applies."""
    sizes: list[int] = []
    real = AgentConsumer._apply

    def counted(self: AgentConsumer, *, burst: list[tuple[str, Any]]) -> list[Any]:
        sizes.append(len(burst))
        return real(self, burst=burst)

    return sizes, mock.patch.object(AgentConsumer, "_apply", counted)


async def answers(client: Any, count: int) -> list[dict[str, Any]]:
    return [await client.receive_json_from(timeout=10) for _ in range(count)]


def states(*task_ids: str) -> list[str]:
    with schema_context("fleet"):
        found = [Task.objects.get(pk=task_id).state for task_id in task_ids]
    connections.close_all()
    return found


def test_what_arrives_while_the_database_is_busy_is_applied_in_one_burst_and_answered_in_order(
    fleet: dict[str, Any],
) -> None:
    second = second_task(fleet)
    sizes, counting = burst_sizes()

    async def scenario() -> list[dict[str, Any]]:
        client, (one, two) = await assigned(fleet, 2)
        stranger = {"task_id": one["task_id"], "lease_id": str(uuid.uuid4())}
        await sent_while_busy(
            client,
            [
                {"type": "accepted", **run_of(one)},
                {"type": "status", **run_of(one), "seq": 1, "state": "running"},
                {"type": "accepted", **stranger},  # no such lease: refused, with a stop
                {"type": "log", **run_of(one), "seq": 2, "lines": ["hello"]},
                {"type": "accepted", **run_of(two)},
                {"type": "status", **run_of(two), "seq": 1, "state": "running"},
            ],
        )
        said = await answers(client, 5)
        assert await client.receive_nothing(timeout=0.3)
        await client.disconnect()
        return said

    with counting:
        said = asyncio.run(scenario())
    # The first is taken at once and waits for the thread; the five sent meanwhile go in one burst. With
    # a trip through the thread before each message, each arrived alone: six bursts.
    assert sizes == [1, 5]
    assert [(m["type"], m.get("verdict"), m.get("seq")) for m in said] == [
        ("ack", "applied", 1),
        ("error", None, None),
        ("abort", None, None),
        ("ack", "applied", 2),
        ("ack", "applied", 1),
    ]
    assert said[1]["about"] == "accepted"
    assert states(fleet["task"], second) == [TaskState.RUNNING, TaskState.RUNNING]


def test_a_malformed_message_is_answered_in_its_place_and_the_others_are_applied(
    fleet: dict[str, Any],
) -> None:
    sizes, counting = burst_sizes()

    async def scenario() -> list[dict[str, Any]]:
        client, (one,) = await assigned(fleet)
        await sent_while_busy(
            client,
            [
                {"type": "accepted", **run_of(one)},
                {"type": "status", **run_of(one), "seq": 0, "state": "running"},  # numbers start at 1
                {"type": "status", **run_of(one), "seq": 1, "state": "running"},
                {"type": "log", **run_of(one), "seq": 2, "lines": "not a list"},
                {"type": "log", **run_of(one), "seq": 3, "lines": ["kept"]},
            ],
        )
        said = await answers(client, 4)
        await client.disconnect()
        return said

    with counting:
        said = asyncio.run(scenario())
    assert [(m["type"], m.get("verdict"), m.get("seq")) for m in said] == [
        ("error", None, None),
        ("ack", "applied", 1),
        ("error", None, None),
        ("ack", "applied", 3),
    ]
    assert said[0]["detail"].startswith("Malformed status")
    assert said[2]["detail"].startswith("Malformed log")
    assert sizes == [1, 1, 1]  # accepted; then each message between two malformed ones
    assert states(fleet["task"]) == [TaskState.RUNNING]
    with schema_context("fleet"):
        kept = sorted(TaskReport.objects.filter(task_id=fleet["task"]).values_list("seq", flat=True))
    connections.close_all()
    assert kept == [1, 3]


def test_a_burst_that_fails_in_the_database_is_applied_again_one_message_at_a_time(
    fleet: dict[str, Any],
) -> None:
    tried: list[int] = []
    real = AgentConsumer._apply

    def deadlocked(self: AgentConsumer, *, burst: list[tuple[str, Any]]) -> list[Any]:
        tried.append(len(burst))
        if len(burst) > 1:
            with transaction.atomic():  # written, then undone with the rest: nothing of it stays
                real(self, burst=burst[:1])
                raise OperationalError("deadlock detected")
        return real(self, burst=burst)

    async def scenario() -> list[dict[str, Any]]:
        client, (one,) = await assigned(fleet)
        await sent_while_busy(
            client,
            [
                {"type": "accepted", **run_of(one)},
                {"type": "status", **run_of(one), "seq": 1, "state": "running"},
                {"type": "log", **run_of(one), "seq": 2, "lines": ["once"]},
            ],
        )
        said = await answers(client, 2)
        assert await client.receive_nothing(timeout=0.3)
        await client.disconnect()
        return said

    with mock.patch.object(AgentConsumer, "_apply", deadlocked):
        said = asyncio.run(scenario())
    assert tried == [1, 2, 1, 1]  # the accepted alone; then the burst of two, failed, and each again
    assert [(m["type"], m["verdict"], m["seq"]) for m in said] == [
        ("ack", "applied", 1),
        ("ack", "applied", 2),
    ]
    assert states(fleet["task"]) == [TaskState.RUNNING]
    with schema_context("fleet"):
        assert TaskReport.objects.filter(task_id=fleet["task"], seq=2).count() == 1
    connections.close_all()


def test_a_burst_that_ends_several_runs_asks_for_one_cycle(fleet: dict[str, Any]) -> None:
    second = second_task(fleet)
    with schema_context("fleet"):  # work that waits: each run's end asks for a cycle
        tasks_submit(
            tenant=fleet["tenant"],
            user=User.objects.get(username="fay"),
            requests=[TaskRequest(compute_resource="Research: 4 GPUs", spec={"command": ["true"]})],
        )
    connections.close_all()
    sizes, counting = burst_sizes()
    asked: list[str] = []

    def ask(request: Any) -> None:
        asked.append(request.schema_name)

    async def scenario() -> list[dict[str, Any]]:
        client, (one, two) = await assigned(fleet, 2)
        for assign in (one, two):
            await client.send_json_to({"type": "accepted", **run_of(assign)})
            await client.send_json_to({"type": "status", **run_of(assign), "seq": 1, "state": "running"})
        assert [m["verdict"] for m in await answers(client, 2)] == ["applied", "applied"]
        asked.clear()
        first = {"type": "log", **run_of(one), "seq": 2, "lines": ["done"]}  # taken alone, at once
        ends = [{"type": "result", **run_of(assign), "seq": 3, "exit_code": 0} for assign in (one, two)]
        await sent_while_busy(client, [first, *ends])
        said = await answers(client, 3)
        await client.disconnect()
        return said

    with counting, mock.patch.object(wake._CycleRequest, "__call__", ask):
        said = asyncio.run(scenario())
    assert sizes[-1] == 2  # both results in one burst, one transaction
    assert [m["verdict"] for m in said] == ["applied", "applied", "applied"]
    assert states(fleet["task"], second) == [TaskState.COMPLETED, TaskState.COMPLETED]
    assert asked == ["fleet"]  # one request for the burst's commit, not one per ended run


def statements_of_bursts() -> tuple[list[list[str]], Any]:
    """Record the statements each burst sends (in the database thread, where the burst runs)."""
    sent: list[list[str]] = []
    real = AgentConsumer._apply

    def captured(self: AgentConsumer, *, burst: list[tuple[str, Any]]) -> list[Any]:
        with CaptureQueriesContext(connection) as queries:
            answered = real(self, burst=burst)
        sent.append([query["sql"] for query in queries.captured_queries])
        return answered

    return sent, mock.patch.object(AgentConsumer, "_apply", captured)


def test_a_burst_that_nobody_refuses_sends_no_savepoint(fleet: dict[str, Any]) -> None:
    sent, capturing = statements_of_bursts()

    async def scenario() -> list[dict[str, Any]]:
        client, (one,) = await assigned(fleet)
        await sent_while_busy(
            client,
            [
                {"type": "accepted", **run_of(one)},
                {"type": "status", **run_of(one), "seq": 1, "state": "running"},
                {"type": "log", **run_of(one), "seq": 2, "lines": ["a"]},
                {"type": "result", **run_of(one), "seq": 3, "exit_code": 0},
            ],
        )
        said = await answers(client, 3)
        await client.disconnect()
        return said

    with capturing:
        said = asyncio.run(scenario())
    assert [m["verdict"] for m in said] == ["applied"] * 3
    assert [len(burst) for burst in sent][-1] > 0
    assert not [sql for burst in sent for sql in burst if "SAVEPOINT" in sql]
    assert states(fleet["task"]) == [TaskState.COMPLETED]


def test_a_message_refused_after_it_wrote_undoes_only_its_own_writes(fleet: dict[str, Any]) -> None:
    second = second_task(fleet)
    real = dispatch.task_report

    def refused_after_writing(**arguments: Any) -> bool:
        kept = real(**arguments)
        if arguments["body"].get("lines") == ["refuse me"]:  # its report row is written, then refused
            raise AgentRejected("refused after writing")
        return kept

    async def scenario() -> tuple[list[dict[str, Any]], str, str]:
        client, (one, two) = await assigned(fleet, 2)
        await sent_while_busy(
            client,
            [
                {"type": "accepted", **run_of(one)},
                {"type": "status", **run_of(one), "seq": 1, "state": "running"},
                {"type": "log", **run_of(one), "seq": 2, "lines": ["refuse me"]},
                {"type": "accepted", **run_of(two)},
                {"type": "status", **run_of(two), "seq": 1, "state": "running"},
                {"type": "log", **run_of(two), "seq": 2, "lines": ["kept"]},
            ],
        )
        said = await answers(client, 4)
        assert await client.receive_nothing(timeout=0.3)
        await client.disconnect()
        return said, one["task_id"], two["task_id"]

    with mock.patch.object(dispatch, "task_report", refused_after_writing):
        said, refused, kept = asyncio.run(scenario())
    assert [(m["type"], m.get("verdict")) for m in said] == [
        ("ack", "applied"),
        ("error", None),
        ("ack", "applied"),
        ("ack", "applied"),
    ]
    assert "refused after writing" in said[1]["detail"]
    with schema_context("fleet"):
        logs = TaskReport.objects.filter(kind="log", task_id__in=[refused, kept])
        written = sorted((str(report.task_id), report.seq) for report in logs)
    connections.close_all()
    assert written == [(kept, 2)]  # the refused one's row is undone, and it alone
    assert states(fleet["task"], second) == [TaskState.RUNNING, TaskState.RUNNING]


def segments_of(*task_ids: str) -> list[int]:
    with schema_context("fleet"):
        found = [LedgerEvent.objects.filter(event_id__startswith=f"gpu:{pk}:").count() for pk in task_ids]
    connections.close_all()
    return found


@pytest.mark.parametrize("refused", [False, True], ids=["all-applied", "one-refused"])
def test_the_runs_a_burst_ends_are_metered_once_each(fleet: dict[str, Any], refused: bool) -> None:
    """Without a refusal, the runs a burst ends are metered in one write to the ledger; with one (the burst
    applied again, a savepoint per message), each kept run still once, and the refused message's nothing."""
    second = second_task(fleet)
    sent, capturing = statements_of_bursts()

    async def scenario() -> list[dict[str, Any]]:
        client, (one, two) = await assigned(fleet, 2)
        stranger = [{"type": "accepted", "task_id": one["task_id"], "lease_id": str(uuid.uuid4())}]
        await sent_while_busy(
            client,
            [
                {"type": "accepted", **run_of(one)},
                {"type": "accepted", **run_of(two)},
                {"type": "status", **run_of(one), "seq": 1, "state": "running"},
                {"type": "status", **run_of(two), "seq": 1, "state": "running"},
                *(stranger if refused else []),
                {"type": "result", **run_of(one), "seq": 2, "exit_code": 0},
                {"type": "result", **run_of(two), "seq": 2, "exit_code": 0},
            ],
        )
        said = await answers(client, 6 if refused else 4)
        await client.disconnect()
        return said

    with capturing:
        said = asyncio.run(scenario())
    assert [m["verdict"] for m in said if m["type"] == "ack"] == ["applied"] * 4
    assert states(fleet["task"], second) == [TaskState.COMPLETED, TaskState.COMPLETED]
    assert segments_of(fleet["task"], second) == [1, 1]
    writes = [len([sql for sql in burst if "INSERT INTO metering_ledgerevent" in sql]) for burst in sent]
    assert writes[-1] == (2 if refused else 1)  # the second pass meters each run with its message
