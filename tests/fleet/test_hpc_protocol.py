"""The plane's side of the cluster backends (HPC and Kubernetes): what an assign carries, the cluster's
pending reason, permanent refusals, a run the cluster could only partly place given back to the queue,
node reporters posting with the task's token, and the pool's view of its cluster's queue."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from django.db import connections
from django.test import Client
from django_tenants.utils import schema_context

from apps.fleet.credentials import task_token
from apps.resources.models import Pool
from apps.scheduling.models import Task, TaskState
from tests.fleet.conftest import HOST, agent
from tests.world import World


def hello(backend: str = "slurm") -> dict[str, Any]:
    return {"type": "hello", "protocol": 2, "agent_id": "login-1", "backend": backend, "held": []}


async def assigned(client: Any) -> dict[str, Any]:
    assert (await client.connect())[0]
    await client.send_json_to(hello())
    assert (await client.receive_json_from(timeout=10))["type"] == "welcome"
    message: dict[str, Any] = await client.receive_json_from(timeout=10)
    assert message["type"] == "assign", message
    return message


def task_row(task_id: str) -> Task:
    with schema_context("fleet"):
        task = Task.objects.get(pk=task_id)
    connections.close_all()
    return task


def test_an_assign_names_the_user_and_carries_a_token_for_that_run(fleet: dict[str, Any]) -> None:
    import asyncio

    async def scenario() -> dict[str, Any]:
        client = agent(fleet["token"].secret)
        message = await assigned(client)
        await client.disconnect()
        return message

    message = asyncio.run(scenario())
    assert message["user"] == "fay"
    assert message["batch"] == {}
    assert message["task_token"].startswith(f"kqt_{message['task_id'].replace('-', '')}_")
    task = task_row(fleet["task"])
    assert message["task_token"] == task_token(schema_name="fleet", task=task)


def test_the_clusters_pending_reason_is_the_tasks_reason_and_a_permanent_refusal_fails_it(
    fleet: dict[str, Any],
) -> None:
    import asyncio

    task_id = fleet["task"]

    async def scenario() -> None:
        client = agent(fleet["token"].secret)
        lease = (await assigned(client))["lease_id"]
        await client.send_json_to(
            {
                "type": "status",
                "task_id": task_id,
                "lease_id": lease,
                "seq": 1,
                "state": "pending",
                "reason": "Resources",
                "job_id": "17",
            }
        )
        assert (await client.receive_json_from(timeout=10))["type"] == "ack"
        await client.send_json_to({"type": "accepted", "task_id": task_id, "lease_id": lease})
        await asyncio.sleep(0.3)
        waiting = await asyncio.to_thread(task_row, task_id)
        assert (waiting.state, waiting.reason_code) == (TaskState.DISPATCHING, "cluster_pending")
        assert waiting.reason.endswith("as job 17: Resources")
        await client.disconnect()

    asyncio.run(scenario())

    # Back to the queue and placed again; this time the agent refuses it for good.
    with schema_context("fleet"):
        Task.objects.filter(pk=task_id).update(state=TaskState.PLACED, lease_id=None)
    connections.close_all()

    async def refused() -> None:
        client = agent(fleet["token"].secret)
        lease = (await assigned(client))["lease_id"]
        reason = "User fay has no Linux account on this cluster: ask an administrator to map them."
        await client.send_json_to(
            {"type": "rejected", "task_id": task_id, "lease_id": lease, "reason": reason, "permanent": True}
        )
        await asyncio.sleep(0.3)
        await client.disconnect()

    asyncio.run(refused())
    task = task_row(task_id)
    assert (task.state, task.reason_code) == (TaskState.FAILED, "refused")
    assert (
        task.reason == "The agent of pool h100 refused it: User fay has no Linux account on this cluster: "
        "ask an administrator to map them."
    )


def in_a_thread(function: Any, *arguments: Any) -> None:
    try:
        function(*arguments)
    finally:
        connections.close_all()  # this thread's connection would outlive the test database


def post(path: str, token: str, body: Any) -> Any:
    return Client().post(
        path,
        data=json.dumps(body),
        content_type="application/json",
        HTTP_HOST=HOST,
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )


def test_node_reporters_post_with_the_task_token_once_per_number_and_only_while_it_runs(
    fleet: dict[str, Any], django_db_blocker: Any
) -> None:
    import asyncio

    task_id = fleet["task"]
    reports = f"/agents/v1/tasks/{task_id}/reports/"

    batch = [
        {"type": "status", "source": "node-0", "seq": 1, "state": "running", "host": "gpu-7"},
        {"type": "log", "source": "node-0", "seq": 2, "stream": "stdout", "lines": ["epoch 1"]},
        {"type": "log", "source": "node-1", "seq": 1, "stream": "stdout", "lines": ["rank 1 ready"]},
    ]

    def over_https(token: str) -> None:
        first = post(reports, token, {"reports": batch})
        again = post(reports, token, {"reports": batch})  # a retried post counts once
        assert (first.status_code, first.json()) == (200, {"kept": 3, "received": 3})
        assert again.json() == {"kept": 0, "received": 3}
        assert task_row(task_id).state == TaskState.RUNNING
        logs = (
            Client()
            .get(
                f"/api/v1/tasks/{task_id}/logs/",
                HTTP_HOST=HOST,
                HTTP_AUTHORIZATION=f"Bearer {fleet['admin_token']}",
            )
            .json()
        )
        assert [(chunk["source"], chunk["lines"]) for chunk in logs] == [
            ("node-0", ["epoch 1"]),
            ("node-1", ["rank 1 ready"]),
        ]
        after = (
            Client()
            .get(
                f"/api/v1/tasks/{task_id}/logs/?after={logs[0]['cursor']}",
                HTTP_HOST=HOST,
                HTTP_AUTHORIZATION=f"Bearer {fleet['admin_token']}",
            )
            .json()
        )
        assert [chunk["lines"] for chunk in after] == [["rank 1 ready"]]
        uploaded = Client().put(
            f"/agents/v1/tasks/{task_id}/outputs/metrics.json",
            data=b'{"loss": 0.1}',
            content_type="application/octet-stream",
            HTTP_HOST=HOST,
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )
        assert uploaded.status_code == 201, uploaded.content

        tampered = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
        assert post(reports, tampered, {"reports": batch}).status_code == 403
        assert post(reports, fleet["token"].secret, {"reports": batch}).status_code == 401  # an agent token
        bad = [
            {"reports": [{"type": "result", "source": "node-0", "seq": 9, "exit_code": 0}]},
            {"reports": [{"type": "log", "source": "agent", "seq": 9, "lines": []}]},
            {"reports": [{"type": "log", "source": "node-0", "seq": -1, "lines": []}]},
            {"reports": "nope"},
        ]
        for body in bad:
            refused = post(reports, token, body)
            assert refused.status_code == 400, (body, refused.content)
            assert refused.json()["detail"]

    async def scenario() -> str:
        client = agent(fleet["token"].secret)
        assignment = await assigned(client)
        token = assignment["task_token"]
        await asyncio.to_thread(in_a_thread, over_https, token)
        await client.send_json_to(
            {
                "type": "result",
                "task_id": task_id,
                "lease_id": assignment["lease_id"],
                "seq": 1,
                "exit_code": 0,
            }
        )
        assert (await client.receive_json_from(timeout=10))["verdict"] == "applied"
        await client.disconnect()
        return str(token)

    with django_db_blocker.unblock():
        token = asyncio.run(scenario())
        late = post(
            reports, token, {"reports": [{"type": "log", "source": "node-0", "seq": 3, "lines": ["x"]}]}
        )
        assert late.status_code == 403
        assert "no longer good" in late.json()["detail"]


def test_a_pool_shows_its_clusters_queue_as_the_agent_last_saw_it(
    fleet: dict[str, Any], django_db_blocker: Any, world: World
) -> None:
    import asyncio

    jobs = [
        {
            "task_id": fleet["task"],
            "job_id": "17",
            "state": "pending",
            "cluster_state": "PENDING",
            "reason": "Priority",
        }
    ]

    async def scenario() -> None:
        client = agent(fleet["token"].secret)
        lease = (await assigned(client))["lease_id"]
        held = [{"task_id": fleet["task"], "lease_id": lease}]
        await client.send_json_to({"type": "heartbeat", "held": held, "queue": jobs})
        await asyncio.sleep(0.5)
        await client.disconnect()

    asyncio.run(scenario())
    with django_db_blocker.unblock():
        with schema_context("fleet"):
            pool = Pool.objects.get(name="h100")
        connections.close_all()
        shown = Client().get(
            f"/api/v1/pools/{pool.pk}/queue/",
            HTTP_HOST=HOST,
            HTTP_AUTHORIZATION=f"Bearer {fleet['admin_token']}",
        )
        assert shown.status_code == 200, shown.content
        [seen] = shown.json()["agents"]
        assert (seen["agent"], seen["jobs"]) == ("login-1", jobs)
        # Another tenant's token cannot see it.
        other = Client().get(
            f"/api/v1/pools/{pool.pk}/queue/",
            HTTP_HOST=HOST,
            HTTP_AUTHORIZATION=f"Bearer {world.tokens['alice']}",
        )
        assert other.status_code in (401, 404)


@pytest.mark.django_db
def test_an_unknown_task_token_is_refused() -> None:
    response = post(
        "/agents/v1/tasks/00000000-0000-0000-0000-000000000000/reports/", "kqt_0000_x", {"reports": []}
    )
    assert response.status_code in (403, 404)


def test_an_assign_names_its_compute_resource_and_tenant(fleet: dict[str, Any]) -> None:
    async def scenario() -> dict[str, Any]:
        client = agent(fleet["token"].secret)
        message = await assigned(client)
        await client.disconnect()
        return message

    message = asyncio.run(scenario())
    task = task_row(fleet["task"])
    assert message["tenant"] == "fleet"
    expected = task.compute_resource.name if task.compute_resource else ""
    assert message["compute_resource"] == expected


def give_back(fleet: dict[str, Any], *, running_first: bool) -> None:
    task_id = fleet["task"]

    async def scenario() -> None:
        client = agent(fleet["token"].secret)
        lease = (await assigned(client))["lease_id"]
        await client.send_json_to({"type": "accepted", "task_id": task_id, "lease_id": lease})
        seq = 1
        if running_first:
            await client.send_json_to(
                {"type": "status", "task_id": task_id, "lease_id": lease, "seq": seq, "state": "running"}
            )
            assert (await client.receive_json_from(timeout=10))["verdict"] == "applied"
            seq += 1
        reason = "only part of the multi-node job could be placed for 120 s (1 of 2 pods placed)"
        await client.send_json_to(
            {
                "type": "result",
                "task_id": task_id,
                "lease_id": lease,
                "seq": seq,
                "exit_code": None,
                "requeue": True,
                "reason": reason,
                "stopped": False,
                "outputs": [],
            }
        )
        ack = await client.receive_json_from(timeout=10)
        assert (ack["type"], ack["verdict"]) == ("ack", "applied")
        await client.disconnect()

    asyncio.run(scenario())


def test_a_run_given_back_before_it_started_waits_in_the_queue_again(fleet: dict[str, Any]) -> None:
    give_back(fleet, running_first=False)
    task = task_row(fleet["task"])
    assert (task.state, task.reason_code) == (TaskState.QUEUED, "requeued_by_agent")
    assert task.reason.startswith("The agent of pool h100 gave it back to the queue: only part of")
    assert task.lease_id is None
    assert task.pool_id is None
    assert task.attempts == 0


def test_a_run_that_started_cannot_be_given_back_it_ended(fleet: dict[str, Any]) -> None:
    give_back(fleet, running_first=True)
    task = task_row(fleet["task"])
    assert task.reason_code != "requeued_by_agent"
    assert task.attempts == 1  # it ran and failed (no exit code): retried or failed by its own policy
    assert task.state != TaskState.RUNNING


def test_a_pool_shows_its_clusters_gpus_per_class_and_what_stops_its_agent(
    fleet: dict[str, Any], django_db_blocker: Any
) -> None:
    problem = (
        "the agent's service account may not create jobs in namespace ml: apply the chart's Role "
        "(deploy/helm/klique-agent) or grant it."
    )
    capacity = {
        "nodes": 2,
        "cpus": 160,
        "cpus_in_use": 8,
        "gpus": [
            {
                "class": "NVIDIA-H100-80GB-HBM3",
                "resource": "nvidia.com/gpu",
                "allocatable": 8,
                "allocated": 2,
            },
            {"class": "A100", "resource": "nvidia.com/mig-1g.10gb", "allocatable": 14, "allocated": 0},
            {"class": "bad", "resource": "nvidia.com/gpu", "allocatable": -1, "allocated": 0},  # left out
            "not an entry",
        ],
    }

    async def scenario(**body: Any) -> dict[str, Any]:
        """What the pools API shows while the agent is connected, after its heartbeat."""
        client = agent(fleet["token"].secret)
        lease = (await assigned(client))["lease_id"]
        held = [{"task_id": fleet["task"], "lease_id": lease}]
        await client.send_json_to({"type": "heartbeat", "held": held, **body})
        await asyncio.sleep(0.5)
        pool = await asyncio.to_thread(shown)
        await client.disconnect()
        return pool

    def shown() -> dict[str, Any]:
        with django_db_blocker.unblock():
            listed = Client().get(
                "/api/v1/pools/", HTTP_HOST=HOST, HTTP_AUTHORIZATION=f"Bearer {fleet['admin_token']}"
            )
            connections.close_all()
        assert listed.status_code == 200, listed.content
        return next(row for row in listed.json()["results"] if row["name"] == "h100")

    h100 = asyncio.run(scenario(capacity=capacity, problem=problem))
    assert h100["gpu_classes"] == [
        {"class": "A100", "resource": "nvidia.com/mig-1g.10gb", "allocatable": 14, "allocated": 0},
        {"class": "NVIDIA-H100-80GB-HBM3", "resource": "nvidia.com/gpu", "allocatable": 8, "allocated": 2},
    ]
    assert h100["problems"] == [f"login-1: {problem}"]
    assert (h100["nodes"], h100["cpus"], h100["cpus_in_use"]) == (2, 160, 8)

    with schema_context("fleet"):  # back on the pool's earlier run: it is still placed, fresh lease
        Task.objects.filter(pk=fleet["task"]).update(state=TaskState.PLACED, lease_id=None)
    connections.close_all()
    fixed = asyncio.run(scenario(problem=""))  # the agent says nothing stops it now
    assert fixed["problems"] == []
    assert fixed["gpu_classes"] == []  # its new hello counted none: unknown, not the old figures
