"""The agent protocol over a real Channels consumer, on committed rows (consumers query from threads)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.fleet.credentials import agent_token_revoke
from apps.fleet.models import TaskReport
from apps.resources.models import Pool
from apps.scheduling.cycle import run_cycle
from apps.scheduling.lifecycle import leases_expire, tasks_of_silent_pools
from apps.scheduling.models import Task, TaskRun, TaskState
from tests.fleet.conftest import agent, in_fleet
from tests.world import World


def test_a_task_goes_from_assign_to_completed_with_each_report_counted_once(fleet: dict[str, Any]) -> None:
    task_id = fleet["task"]

    async def scenario() -> list[dict[str, Any]]:
        client = agent(fleet["token"].secret)
        assert (await client.connect())[0]
        await client.send_json_to(
            {"type": "hello", "protocol": 2, "agent_id": "rack-1", "backend": "baremetal", "held": []}
        )
        welcome = await client.receive_json_from(timeout=10)
        assert welcome["type"] == "welcome", welcome
        assign = await client.receive_json_from(timeout=10)
        lease = assign["lease_id"]
        await client.send_json_to({"type": "accepted", "task_id": task_id, "lease_id": lease})
        replies = []
        run = {"task_id": task_id, "lease_id": lease}
        for message in (
            {"type": "status", **run, "seq": 1, "state": "running"},
            {"type": "log", **run, "seq": 2, "stream": "stdout", "lines": ["hello"]},
            {"type": "log", **run, "seq": 2, "stream": "stdout", "lines": ["hello"]},  # a replay
            {"type": "result", **run, "seq": 3, "exit_code": 0},
            {"type": "log", **run, "seq": 4, "stream": "stdout", "lines": ["late"]},  # after the end
        ):
            await client.send_json_to(message)
            replies.append(await client.receive_json_from(timeout=10))
        await client.disconnect()
        return [welcome, assign, *replies]

    welcome, assign, *acks = asyncio.run(scenario())
    assert welcome["type"] == "welcome"
    assert (assign["type"], assign["task_id"], assign["spec"]) == ("assign", task_id, {"command": ["true"]})
    assert [(ack["seq"], ack["verdict"]) for ack in acks] == [
        (1, "applied"),
        (2, "applied"),
        (2, "duplicate"),
        (3, "applied"),
        (4, "stale"),
    ]
    assert (assign["attempt"], acks[-1]["lease_id"]) == (1, assign["lease_id"])
    with schema_context("fleet"):
        task = Task.objects.get(pk=task_id)
        assert (task.state, task.attempts, task.exit_code) == (TaskState.COMPLETED, 1, 0)
        assert TaskReport.objects.filter(task=task, kind="log").count() == 1
        states = list(task.events.values_list("to_state", flat=True))
    assert states == ["queued", "placed", "dispatching", "running", "completed"]
    connections.close_all()


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ({"type": "teleport"}, "Unknown message type 'teleport'"),
        ({"type": "status", "task_id": "x"}, "Malformed status: lease_id must be a string"),
        ({"type": "log", "task_id": "x", "lease_id": "y", "seq": 0}, "seq must be a whole number"),
        ({"type": "log", "task_id": "x", "lease_id": "y", "seq": 1, "lines": "z"}, "lines must be a list"),
        ({"type": "result", "task_id": "x", "lease_id": "y", "seq": 1, "exit_code": "0"}, "exit_code"),
        ({"type": "heartbeat", "held": [{"task_id": "x"}]}, "lease_id must be a string"),
        ({"type": "heartbeat", "held": "x"}, "held must be a list"),
        ("just text", "Each message is a JSON object"),
    ],
)
def test_bad_messages_get_an_error_that_names_the_problem(
    fleet: dict[str, Any], message: object, fragment: str
) -> None:
    async def scenario() -> dict[str, Any]:
        client = agent(fleet["token"].secret)
        await client.connect()
        await client.send_json_to({"type": "hello", "protocol": 2, "agent_id": "rack-1", "held": []})
        await client.receive_json_from(timeout=10)  # welcome
        await client.receive_json_from(timeout=10)  # the assignment
        await client.send_json_to(message)
        reply: dict[str, Any] = await client.receive_json_from(timeout=10)
        await client.disconnect()
        return reply

    reply = asyncio.run(scenario())
    assert reply["type"] == "error"
    assert fragment in reply["detail"]
    connections.close_all()


def test_an_assignment_of_another_pool_cannot_be_acknowledged(fleet: dict[str, Any]) -> None:
    async def scenario() -> dict[str, Any]:
        client = agent(fleet["other"].secret)  # baremetal's agent
        await client.connect()
        await client.send_json_to({"type": "hello", "protocol": 2, "agent_id": "rack-2", "held": []})
        await client.receive_json_from(timeout=10)
        await client.send_json_to({"type": "accepted", "task_id": fleet["task"], "lease_id": "whatever"})
        reply: dict[str, Any] = await client.receive_json_from(timeout=10)
        await client.disconnect()
        return reply

    assert "No lease whatever on task" in asyncio.run(scenario())["detail"]
    connections.close_all()


def test_agents_report_their_cpus_and_nodes_and_nonsense_is_kept_as_unknown(fleet: dict[str, Any]) -> None:
    from apps.fleet.models import Agent

    def seen() -> tuple[int | None, int | None, int | None]:
        with schema_context("fleet"):
            found = Agent.objects.get(pk="rack-cpu")
            return found.cpus, found.cpus_in_use, found.nodes

    async def scenario() -> list[tuple[int | None, int | None, int | None]]:
        client = agent(fleet["other"].secret)  # baremetal's agent: no work waits there
        await client.connect()
        capacity = {"cpus": 128, "cpus_in_use": 12, "nodes": 2}
        await client.send_json_to(
            {"type": "hello", "protocol": 2, "agent_id": "rack-cpu", "held": [], "capacity": capacity}
        )
        await client.receive_json_from(timeout=10)  # welcome
        states = [await in_fleet(seen)]
        for reported in (
            {"cpus": -4, "cpus_in_use": "many", "nodes": True},
            {"cpus": 128, "cpus_in_use": 100, "nodes": 2},
            None,  # a heartbeat without figures leaves the last ones
        ):
            beat: dict[str, Any] = {"type": "heartbeat", "held": []}
            if reported is not None:
                beat["capacity"] = reported
            await client.send_json_to(beat)
            await client.send_json_to({"type": "teleport"})  # its error reply says the heartbeat is done
            await client.receive_json_from(timeout=10)
            states.append(await in_fleet(seen))
        await client.disconnect()
        return states

    assert asyncio.run(scenario()) == [(128, 12, 2), (None, None, None), (128, 100, 2), (128, 100, 2)]
    connections.close_all()


def test_a_revoked_token_is_disconnected_and_refused(fleet: dict[str, Any]) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        client = agent(fleet["token"].secret)
        await client.connect()
        await client.send_json_to({"type": "hello", "protocol": 2, "agent_id": "rack-1", "held": []})
        await client.receive_json_from(timeout=10)
        await client.receive_json_from(timeout=10)
        await in_fleet(lambda: agent_token_revoke(tenant=fleet["tenant"], token=fleet["token"].token))
        # The revocation is published after commit; outside a transaction that is at once.
        error = await client.receive_json_from(timeout=10)
        closed = await client.receive_output(timeout=10)
        again = agent(fleet["token"].secret)
        await again.connect()
        refused = await again.receive_json_from(timeout=10)
        return error, closed, refused

    error, closed, refused = asyncio.run(scenario())
    assert error == {"type": "error", "detail": "This agent token was revoked.", "about": ""}
    assert closed == {"type": "websocket.close", "code": 4401}
    assert "was revoked" in refused["detail"]
    connections.close_all()


def test_unacknowledged_leases_and_silent_pools_give_their_tasks_back(fleet: dict[str, Any]) -> None:
    with schema_context("fleet"):
        from apps.fleet.dispatch import dispatch

        task = Task.objects.select_related("pool").get(pk=fleet["task"])
        assert task.pool is not None
        assert len(dispatch(pool=task.pool, schema_name="fleet")) == 1
        Task.objects.filter(pk=task.pk).update(lease_expires_at=timezone.now())
        assert leases_expire() == 1
        task.refresh_from_db()
        assert (task.state, task.reason_code, task.pool_id) == (TaskState.QUEUED, "lease_expired", None)
        assert task.runs.get().outcome == "expired"

        run_cycle(fleet["tenant"])
        task.refresh_from_db()
        assert len(dispatch(pool=task.pool, schema_name="fleet", agent_id="rack-1")) == 1
        Task.objects.filter(pk=task.pk).update(state=TaskState.RUNNING, attempts=1)
        Pool.objects.filter(name="h100").update(last_heartbeat_at=None)
        assert tasks_of_silent_pools(tenant=fleet["tenant"]) == 1
        task.refresh_from_db()
        assert (task.state, task.reason_code) == (TaskState.QUEUED, "run_lost")
        assert "pool h100 went silent" in task.reason
        assert [(run.attempt, run.outcome, run.agent_id) for run in task.runs.all()] == [
            (1, "expired", ""),
            (2, "lost", "rack-1"),
        ]
    connections.close_all()


@pytest.mark.parametrize(
    ("presented", "fragment"),
    [
        ("klq_abcdefgh_" + "x" * 32, "Malformed agent token"),
        ("kqa_00000000_nope", "Unknown agent token"),
    ],
)
def test_agent_tokens_are_checked(world: World, db: None, presented: str, fragment: str) -> None:
    """(Also the module's one test on the rolled-back database, which makes pytest-django set it up.)"""
    from apps.fleet.credentials import agent_authenticate
    from apps.fleet.errors import AgentRejected

    with schema_context("acme"), pytest.raises(AgentRejected, match=fragment):
        agent_authenticate(presented=presented)
    with schema_context("acme"):
        token = agent_authenticate(presented=world.agent_secret_a)
        assert token.pool.name == "h100"
        agent_token_revoke(tenant=world.tenant_a, token=token)
        with pytest.raises(AgentRejected, match="was revoked; issue a new one for pool h100"):
            agent_authenticate(presented=world.agent_secret_a)


def test_an_agent_uploads_outputs_of_its_own_pool_s_tasks_only(world: World, db: None) -> None:
    from rest_framework.test import APIClient

    lease = uuid.uuid4()
    with schema_context("acme"):
        h100 = Pool.objects.get(name="h100")
        Task.objects.filter(pk=world.task_a).update(state=TaskState.RUNNING, pool=h100, lease_id=lease)
        TaskRun.objects.create(
            lease_id=lease, task_id=world.task_a, attempt=1, pool=h100, dispatched_at=timezone.now()
        )
    agent_client = APIClient(
        HTTP_HOST="acme.klique.test",
        HTTP_AUTHORIZATION=f"Bearer {world.agent_secret_a}",
        HTTP_X_KLIQUE_LEASE=str(lease),
    )
    url = f"/agents/v1/tasks/{world.task_a}/outputs/model/weights.bin"
    created = agent_client.put(url, b"\x00\x01weights", content_type="application/octet-stream")
    assert created.status_code == 201, created.content
    assert created.json()["size"] == 9
    bad_name = agent_client.put(
        f"/agents/v1/tasks/{world.task_a}/outputs/../escape", b"x", content_type="a/b"
    )
    assert bad_name.status_code in {400, 404}
    user_token = APIClient(HTTP_HOST="acme.klique.test", HTTP_AUTHORIZATION=f"Bearer {world.tokens['bob']}")
    assert user_token.put(url, b"x", content_type="a/b").status_code == 403  # user tokens open no agent door
    with schema_context("acme"):
        Task.objects.filter(pk=world.task_a).update(pool=Pool.objects.get(name="baremetal"))
    assert agent_client.put(url, b"x", content_type="a/b").status_code == 403  # another pool's task

    bob = APIClient(HTTP_HOST="acme.klique.test", HTTP_AUTHORIZATION=f"Bearer {world.tokens['bob']}")
    listed = {output["name"] for output in bob.get(f"/api/v1/tasks/{world.task_a}/outputs/").json()}
    assert listed == {"result.txt", "model/weights.bin"}
    download = bob.get(f"/api/v1/tasks/{world.task_a}/outputs/model/weights.bin")
    assert download.status_code == 200
    assert download.getvalue() == b"\x00\x01weights"
