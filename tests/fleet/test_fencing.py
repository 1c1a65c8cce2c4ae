"""Leases fence what agents say: each report is applied to the run it names or answered stale; runs of an
agent that was away are kept, not run twice; stops are desired state; no message ends the consumer.

Each test drives the real Channels consumer on committed rows, as an agent would, with the faults the
plane sees from its side (an agent silent past the pool's timeout, a result that arrives after a retry,
a second agent on the pool, an abort whose notice was lost, a database that fails mid-message)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import OperationalError, connections
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.fleet import credentials, dispatch, session
from apps.fleet.models import Agent, TaskReport
from apps.resources.models import Pool
from apps.scheduling import lifecycle, wake
from apps.scheduling.cycle import run_cycle
from apps.scheduling.models import Task, TaskRun, TaskState
from apps.scheduling.reads import snapshot
from apps.scheduling.services import TaskRequest, task_cancel, tasks_submit
from tests.fleet.conftest import agent, in_fleet


def hello(agent_id: str = "rack-1", held: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "hello", "protocol": 2, "agent_id": agent_id, "backend": "baremetal", "held": held or []}


def run_of(assign: dict[str, Any]) -> dict[str, str]:
    return {"task_id": assign["task_id"], "lease_id": assign["lease_id"]}


async def receive(client: Any, kind: str) -> dict[str, Any]:
    """The next message of this type (others, such as acks of earlier reports, are skipped)."""
    for _ in range(20):
        message: dict[str, Any] = await client.receive_json_from(timeout=10)
        if message["type"] == kind:
            return message
    raise AssertionError(f"no {kind} message")


async def start(client: Any, agent_id: str = "rack-1", count: int = 1) -> list[dict[str, Any]]:
    """Connect, say hello, accept `count` assignments and report each running; the assignments."""
    assert (await client.connect())[0]
    await client.send_json_to(hello(agent_id))
    await receive(client, "welcome")
    assigns = [await receive(client, "assign") for _ in range(count)]
    for assign in assigns:
        await client.send_json_to({"type": "accepted", **run_of(assign)})
        await client.send_json_to({"type": "status", **run_of(assign), "seq": 1, "state": "running"})
        assert (await receive(client, "ack"))["verdict"] == "applied"
    return assigns


def second_task(fleet: dict[str, Any]) -> str:
    """Queue and place another 4-GPU task in h100 (it holds 8)."""
    with schema_context("fleet"):
        (task,) = tasks_submit(
            tenant=fleet["tenant"],
            user=User.objects.get(username="fay"),
            requests=[TaskRequest(compute_resource="Research: 4 GPUs", spec={"command": ["true"]})],
        )
        run_cycle(fleet["tenant"])
        assert Task.objects.get(pk=task.pk).state == TaskState.PLACED
    connections.close_all()
    return str(task.pk)


def lose(fleet: dict[str, Any]) -> int:
    with schema_context("fleet"):
        long_ago = timezone.now() - timedelta(days=2)
        Pool.objects.filter(name="h100").update(last_heartbeat_at=long_ago)
        Agent.objects.update(last_heartbeat_at=long_ago, connected=False)
        lost = lifecycle.tasks_of_silent_pools(tenant=fleet["tenant"])
    connections.close_all()
    return lost


def rows(task_id: str) -> tuple[Task, list[TaskRun], list[str]]:
    with schema_context("fleet"):
        task = Task.objects.get(pk=task_id)
        task_runs = list(task.runs.order_by("attempt"))
        events = list(task.events.values_list("message", flat=True))
    connections.close_all()
    return task, task_runs, events


def test_an_agent_back_after_the_timeout_keeps_its_finished_run_and_its_running_run(
    fleet: dict[str, Any],
) -> None:
    finished, going = fleet["task"], second_task(fleet)

    async def before() -> list[dict[str, Any]]:
        client = agent(fleet["token"].secret)
        assigns = await start(client, count=2)
        await client.disconnect()  # killed
        return assigns

    assigns = {assign["task_id"]: assign for assign in asyncio.run(before())}
    assert lose(fleet) == 2  # the pool went silent: both given up, waiting in the queue
    task, _, _ = rows(finished)
    assert (task.state, task.reason_code) == (TaskState.QUEUED, "run_lost")
    assert "pool h100 went silent" in task.reason

    async def back() -> tuple[dict[str, Any], dict[str, Any]]:
        client = agent(fleet["token"].secret)
        assert (await client.connect())[0]
        held = [{**run_of(assigns[finished]), "ended": True}, {**run_of(assigns[going]), "ended": False}]
        await client.send_json_to(hello(held=held))
        welcome = await receive(client, "welcome")
        # The outbox replays the finished run's result (it ended with exit 0 while the agent was away).
        await client.send_json_to({"type": "result", **run_of(assigns[finished]), "seq": 2, "exit_code": 0})
        ack = await receive(client, "ack")
        assert await client.receive_nothing(timeout=0.5)  # nothing assigned again
        await client.disconnect()
        return welcome, ack

    welcome, ack = asyncio.run(back())
    assert {run["task_id"] for run in welcome["keep"]} == {finished, going}
    assert welcome["stop"] == []
    assert ack["verdict"] == "applied"
    task, task_runs, events = rows(finished)
    assert (task.state, task.exit_code, task.attempts) == (TaskState.COMPLETED, 0, 1)
    assert [(run.attempt, run.outcome) for run in task_runs] == [(1, "completed")]
    assert any(event.startswith("adopted: agent rack-1 came back with attempt 1") for event in events)
    task, task_runs, _ = rows(going)
    assert (task.state, task.attempts, task.reason_code) == (TaskState.RUNNING, 1, "adopted")
    assert [(run.attempt, run.outcome, run.agent_id) for run in task_runs] == [(1, "", "rack-1")]


def test_a_result_of_a_run_given_up_cannot_end_the_next_attempt_and_is_kept_as_a_duplicate(
    fleet: dict[str, Any],
) -> None:
    task_id = fleet["task"]

    async def first() -> dict[str, Any]:
        client = agent(fleet["token"].secret)
        (assign,) = await start(client)
        await client.disconnect()
        return assign

    old = asyncio.run(first())
    assert lose(fleet) == 1
    with schema_context("fleet"):  # the pool is back through another agent, which gets the retry
        Pool.objects.filter(name="h100").update(last_heartbeat_at=timezone.now())
        run_cycle(fleet["tenant"])
        (retry,) = dispatch.dispatch(
            pool=Pool.objects.get(name="h100"), schema_name="fleet", agent_id="rack-2"
        )
    connections.close_all()

    async def late() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        client = agent(fleet["token"].secret)
        assert (await client.connect())[0]
        await client.send_json_to(hello(held=[{**run_of(old), "ended": True}]))
        welcome = await receive(client, "welcome")
        replies = []
        for message in (
            {"type": "log", **run_of(old), "seq": 2, "stream": "stdout", "lines": ["from the first run"]},
            {"type": "result", **run_of(old), "seq": 3, "exit_code": -9},
            {"type": "result", **run_of(old), "seq": 3, "exit_code": -9},  # the outbox's replay
        ):
            await client.send_json_to(message)
            replies.append(await receive(client, "ack"))
        await client.disconnect()
        return welcome, replies

    welcome, replies = asyncio.run(late())
    assert welcome["keep"] == []
    assert welcome["stop"] == []
    assert [reply["verdict"] for reply in replies] == ["stale", "stale", "stale"]
    assert "recorded as a duplicate run" in replies[1]["detail"]
    task, task_runs, events = rows(task_id)
    assert (task.state, str(task.lease_id)) == (TaskState.DISPATCHING, retry["lease_id"])  # untouched
    assert [(run.attempt, run.outcome, run.exit_code) for run in task_runs] == [
        (1, "duplicate", -9),
        (2, "", None),
    ]
    assert any(event.startswith("duplicate run: attempt 1 ended with exit code -9") for event in events)
    with schema_context("fleet"):
        assert not TaskReport.objects.filter(task_id=task_id, body__lines=["from the first run"]).exists()
    connections.close_all()


def test_a_second_agent_on_the_pool_leaves_the_first_agents_runs_alone(fleet: dict[str, Any]) -> None:
    with schema_context("fleet"):
        other = credentials.agent_token_create(pool=Pool.objects.get(name="h100"), name="rack-2")
    connections.close_all()

    async def scenario() -> dict[str, Any]:
        first = agent(fleet["token"].secret)
        await start(first)
        second = agent(other.secret)
        assert (await second.connect())[0]
        await second.send_json_to(hello("rack-2"))
        welcome = await receive(second, "welcome")
        await second.disconnect()
        await first.disconnect()
        return welcome

    welcome = asyncio.run(scenario())
    assert welcome["keep"] == []
    task, task_runs, _ = rows(fleet["task"])
    assert task.state == TaskState.RUNNING
    assert [(run.agent_id, run.outcome) for run in task_runs] == [("rack-1", "")]


def test_reports_about_runs_that_are_not_the_tasks_are_answered_stale_not_crashed_on(
    fleet: dict[str, Any],
) -> None:
    """A result for a task that is only placed, for an unknown lease, for another pool's task; an
    acceptance of a lease that is not live is answered with an abort of that run."""
    task_id = fleet["task"]

    async def scenario() -> list[dict[str, Any]]:
        client = agent(fleet["other"].secret)  # baremetal's agent; the task is placed in h100
        assert (await client.connect())[0]
        await client.send_json_to(hello("bm-1"))
        await receive(client, "welcome")
        replies = []
        for lease in ("00000000-0000-0000-0000-000000000000", "not-a-lease"):
            await client.send_json_to({"type": "result", "task_id": task_id, "lease_id": lease, "seq": 1,
                                       "exit_code": 0})  # fmt: skip
            replies.append(await client.receive_json_from(timeout=10))
        await client.send_json_to({"type": "accepted", "task_id": task_id, "lease_id": "gone"})
        replies += [await client.receive_json_from(timeout=10), await client.receive_json_from(timeout=10)]
        await client.disconnect()
        return replies

    stale, malformed, refused, abort = asyncio.run(scenario())
    assert (stale["type"], stale["verdict"]) == ("ack", "stale")
    assert (malformed["type"], malformed["verdict"]) == ("ack", "stale")
    assert refused["type"] == "error"
    assert "is live" in refused["detail"]
    assert (abort["type"], abort["lease_id"]) == ("abort", "gone")
    task, _, _ = rows(task_id)
    assert task.state == TaskState.PLACED


def test_an_expired_lease_whose_run_reports_after_all_is_the_tasks_run_again(fleet: dict[str, Any]) -> None:
    async def scenario() -> dict[str, Any]:
        client = agent(fleet["token"].secret)
        assert (await client.connect())[0]
        await client.send_json_to(hello())
        await receive(client, "welcome")
        assign = await receive(client, "assign")

        def expire() -> None:
            from apps.scheduling.lifecycle import leases_expire

            Task.objects.filter(pk=assign["task_id"]).update(lease_expires_at=timezone.now())
            assert leases_expire() == 1

        await in_fleet(expire)
        await client.send_json_to({"type": "status", **run_of(assign), "seq": 1, "state": "running"})
        ack = await receive(client, "ack")
        await client.disconnect()
        return ack

    ack = asyncio.run(scenario())
    assert ack["verdict"] == "applied", ack.get("detail")
    task, task_runs, _ = rows(fleet["task"])
    assert (task.state, task.attempts) == (TaskState.RUNNING, 1)
    assert [run.outcome for run in task_runs] == [""]
    assert task.spec == {"command": ["true"]}  # adopted as it was: its spec saved back whole, not as text


def test_an_abort_is_asked_for_until_the_agent_lets_the_run_go_and_its_gpus_wait_for_that(
    fleet: dict[str, Any],
) -> None:
    """The abort's notice is lost (as in a Redis outage): the next heartbeat that lists the run is answered
    with the abort again, and the pool's GPUs are not handed out while the agent still holds it."""

    def free_units() -> int:
        with schema_context("fleet"):
            state, _shown = snapshot(fleet["tenant"], timezone.now())
            h100 = str(Pool.objects.get(name="h100").pk)
        connections.close_all()
        return next(pool.capacity for pool in state.pools if pool.id == h100)

    async def scenario() -> tuple[dict[str, Any], int, int]:
        client = agent(fleet["token"].secret)
        (assign,) = await start(client)

        def cancel() -> None:
            with mock.patch.object(wake, "notify_pool"):  # the live notice never arrives
                fay = User.objects.get(username="fay")
                task_cancel(tenant=fleet["tenant"], user=fay, task=Task.objects.get(pk=assign["task_id"]))

        await in_fleet(cancel)
        await client.send_json_to({"type": "heartbeat", "held": [run_of(assign)]})
        abort = await receive(client, "abort")
        held_back = await asyncio.to_thread(free_units)
        await client.send_json_to({"type": "result", **run_of(assign), "seq": 2, "exit_code": -15})
        await receive(client, "ack")
        await client.send_json_to({"type": "heartbeat", "held": []})
        assert await client.receive_nothing(timeout=0.5)
        freed = await asyncio.to_thread(free_units)
        await client.disconnect()
        return abort, held_back, freed

    abort, held_back, freed = asyncio.run(scenario())
    assert (abort["task_id"], abort["grace_seconds"]) == (fleet["task"], 0)
    assert (held_back, freed) == (4 * 840, 8 * 840)
    task, task_runs, _ = rows(fleet["task"])
    assert task.state == TaskState.ABORTED
    assert [(run.outcome, run.stop, run.exit_code, run.released_at is not None) for run in task_runs] == [
        ("stopped", "abort", -15, True)
    ]


@pytest.mark.parametrize("let_go_by", ["its result", "a heartbeat without it", "its agent leaving"])
def test_a_stopped_run_let_go_asks_for_a_cycle_at_once(fleet: dict[str, Any], let_go_by: str) -> None:
    """The GPUs of an aborted (or preempted) run are free only when its agent lets it go; the tasks waiting
    for them are placed by the cycle that release asks for, not by the next safety-net cycle."""
    asked: list[str] = []

    async def scenario() -> tuple[int, int, int]:
        client = agent(fleet["token"].secret)
        (assign,) = await start(client)

        def cancel() -> None:
            fay = User.objects.get(username="fay")
            task_cancel(tenant=fleet["tenant"], user=fay, task=Task.objects.get(pk=assign["task_id"]))

        await in_fleet(cancel)
        await receive(client, "abort")
        before = len(asked)
        await client.send_json_to({"type": "heartbeat", "held": [run_of(assign)]})  # still holds it
        await receive(client, "abort")
        holding = len(asked)
        if let_go_by == "its result":
            await client.send_json_to({"type": "result", **run_of(assign), "seq": 2, "exit_code": -15})
            await receive(client, "ack")
        elif let_go_by == "a heartbeat without it":
            await client.send_json_to({"type": "heartbeat", "held": []})
            assert await client.receive_nothing(timeout=0.5)
        await client.disconnect()  # (a connection that closes while the run is let go asks for no more)
        released = len(asked)
        return before, holding, released

    def record(tenant: Any) -> None:
        asked.append(tenant.schema_name)

    with mock.patch.object(wake, "request_cycle", side_effect=record):
        before, holding, released = asyncio.run(scenario())
    assert holding == before  # a heartbeat that still holds the run frees nothing
    assert released > holding
    assert set(asked) == {"fleet"}
    _, task_runs, _ = rows(fleet["task"])
    assert (task_runs[0].released_at is not None) is (let_go_by != "its agent leaving")


def test_a_database_error_mid_message_closes_with_1011_and_at_connect_refuses_the_handshake(
    fleet: dict[str, Any],
) -> None:
    async def scenario() -> tuple[Any, Any, Any]:
        client = agent(fleet["token"].secret)
        await start(client)
        with mock.patch.object(session, "agent_heartbeat", side_effect=OperationalError("server closed")):
            await client.send_json_to({"type": "heartbeat", "held": []})
            error = await client.receive_json_from(timeout=10)
            closed = await client.receive_output(timeout=10)
        with mock.patch.object(
            credentials, "agent_authenticate", side_effect=OperationalError("no database")
        ):
            refused = await agent(fleet["token"].secret).connect()
        return error, closed, refused

    error, closed, refused = asyncio.run(scenario())
    assert error["type"] == "error"
    assert "database is unavailable" in error["detail"]
    assert closed == {"type": "websocket.close", "code": 1011}
    assert refused == (False, 1011)


FAILING_FIRST = [
    ("heartbeat", session, "agent_heartbeat", lambda assign: {"type": "heartbeat", "held": [run_of(assign)]}),
    (
        "report",
        dispatch,
        "report",
        lambda assign: {"type": "log", **run_of(assign), "seq": 2, "lines": ["two"]},
    ),
    ("accepted", dispatch, "lease_accepted", lambda assign: {"type": "accepted", **run_of(assign)}),
]


@pytest.mark.parametrize(
    ("kind", "module", "service", "first"), FAILING_FIRST, ids=[case[0] for case in FAILING_FIRST]
)
def test_after_a_message_fails_nothing_later_on_that_connection_is_applied(
    fleet: dict[str, Any],
    kind: str,
    module: Any,
    service: str,
    first: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    """The agent replays everything unanswered on its next connection, in order: a report sent after the
    failed message and applied on the closing connection would land before the replayed one (the run's
    log out of order, as a database restart under load once showed)."""
    applied: list[int] = []
    report = dispatch.report

    def recording(**arguments: Any) -> Any:
        seq = arguments["message"].seq
        applied.append(seq)
        if kind == "report" and seq == 2:
            raise OperationalError("server closed")
        return report(**arguments)

    async def scenario() -> tuple[dict[str, Any], Any]:
        client = agent(fleet["token"].secret)
        (assign,) = await start(client)
        with contextlib.ExitStack() as patches:
            patches.enter_context(mock.patch.object(dispatch, "report", side_effect=recording))
            if kind != "report":
                failure = OperationalError("server closed")
                patches.enter_context(mock.patch.object(module, service, side_effect=failure))
            await client.send_json_to(first(assign))
            for seq in (3, 4):  # sent before the plane answered the first
                await client.send_json_to({"type": "log", **run_of(assign), "seq": seq, "lines": [str(seq)]})
            error = await client.receive_json_from(timeout=10)
            closed = await client.receive_output(timeout=10)
            await asyncio.sleep(0.5)  # time for anything queued behind the failure to be (wrongly) handled
        return error, closed

    error, closed = asyncio.run(scenario())
    assert "database is unavailable" in error["detail"]
    assert closed == {"type": "websocket.close", "code": 1011}
    assert applied == ([2] if kind == "report" else [])  # the failed one, and nothing after it
    with schema_context("fleet"):
        assert not TaskReport.objects.filter(task_id=fleet["task"], seq__in=(2, 3, 4)).exists()


def test_an_agent_of_an_older_protocol_is_told_what_to_install(fleet: dict[str, Any]) -> None:
    async def scenario() -> dict[str, Any]:
        client = agent(fleet["token"].secret)
        assert (await client.connect())[0]
        await client.send_json_to({"type": "hello", "agent_id": "rack-1", "running": []})
        reply: dict[str, Any] = await client.receive_json_from(timeout=10)
        await client.disconnect()
        return reply

    reply = asyncio.run(scenario())
    assert reply["type"] == "error"
    assert "install the klique-agent" in reply["detail"]


def test_an_agent_upgraded_while_its_run_goes_on_learns_the_runs_lease_and_loses_nothing(
    fleet: dict[str, Any],
) -> None:
    """An agent from before leases holds a run it cannot name: its hello lists it with lease "", the
    welcome names the lease, and its reports without one go to that run, once."""

    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        client = agent(fleet["token"].secret)
        (assign,) = await start(client)
        await client.disconnect()
        again = agent(fleet["token"].secret)
        assert (await again.connect())[0]
        await again.send_json_to(hello(held=[{"task_id": assign["task_id"], "lease_id": ""}]))
        welcome = await receive(again, "welcome")
        acks = []
        for seq in (2, 2):
            unnamed = {
                "type": "log",
                "task_id": assign["task_id"],
                "lease_id": "",
                "seq": seq,
                "lines": ["x"],
            }
            await again.send_json_to(unnamed)
            acks.append(await receive(again, "ack"))
        await again.disconnect()
        return welcome, [assign, *acks]

    welcome, (assign, applied, duplicate) = asyncio.run(scenario())
    assert welcome["keep"] == [{"task_id": assign["task_id"], "lease_id": assign["lease_id"], "ended": False}]
    assert welcome["stop"] == []
    assert (applied["verdict"], duplicate["verdict"]) == ("applied", "duplicate")
    task, _, _ = rows(fleet["task"])
    assert task.state == TaskState.RUNNING
    with schema_context("fleet"):
        kept = TaskReport.objects.filter(task_id=fleet["task"], kind="log").values_list("lease_id", flat=True)
        assert [str(lease) for lease in kept] == [assign["lease_id"]]
    connections.close_all()
