"""The plane's half of a cloud pool's autoscaling: who may mint an instance's token and what it is good
for, handoffs fenced by the run's lease, the instance's agent getting exactly the runs handed to it, and
an instance's end putting its work back at the front of the queue.

The autoscaler and the instance agents are driven through the real Channels consumer and the real HTTP
views, on committed rows."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connections
from django.test import Client
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.configuration.services import draft_provision, draft_save
from apps.fleet import credentials
from apps.fleet.models import AgentToken, CloudInstance
from apps.resources.models import Pool
from apps.scheduling.cycle import run_cycle
from apps.scheduling.models import RunOutcome, Task, TaskEvent, TaskRun, TaskState
from apps.scheduling.services import TaskRequest, tasks_submit
from protocol import cloud
from tests.fleet.conftest import HOST, agent, in_fleet
from tests.fleet.test_fencing import receive, run_of
from tests.scheduling.config import acme_document

CLOUD_POOL = {
    "name": "spot-a10",
    "environment": "cloud",
    "capacity_gpus": 8,
    "gpu_class": "A10G",
    "region": "us-east-1",
    "heartbeat_timeout_seconds": 90,
}


@pytest.fixture
def clouded(fleet: dict[str, Any]) -> dict[str, Any]:
    """The fleet tenant with a cloud pool "spot-a10" (first in a profile of its own), its autoscaler's
    token, and two 1-GPU tasks submitted there."""
    with schema_context("fleet"):
        fay = User.objects.get(username="fay")
        document = acme_document()
        document["profiles"][0]["pools"] = [{"pool": "h100"}]
        document["pools"].append(CLOUD_POOL)
        document["profiles"].append({"name": "cloud-one", "gpus": "1", "pools": [{"pool": "spot-a10"}]})
        document["policies"][0]["compute_resources"].append(
            {"profile": "cloud-one", "name": "Research: cloud"}
        )
        draft_save(tenant=fleet["tenant"], user=fay, document=document)
        draft_provision(tenant=fleet["tenant"], user=fay)
        pool = Pool.objects.get(name="spot-a10")
        issued = credentials.agent_token_create(pool=pool, name="autoscaler")
        tasks = tasks_submit(
            tenant=fleet["tenant"],
            user=fay,
            requests=[
                TaskRequest(compute_resource="Research: cloud", spec={"command": ["true"]}) for _ in range(2)
            ],
        )
    connections.close_all()
    return {**fleet, "scaler": issued.secret, "tasks": [str(task.pk) for task in tasks]}


def hello(agent_id: str, backend: str = "cloud", held: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "hello", "protocol": 2, "agent_id": agent_id, "backend": backend, "held": held or []}


def post(token: str, path: str, body: object) -> tuple[int, dict[str, Any]]:
    """An autoscaler's HTTPS call (from a worker thread: its database connection is closed after)."""
    try:
        response = Client().post(
            path, data=json.dumps(body), content_type="application/json", HTTP_HOST=HOST,
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )  # fmt: skip
        return response.status_code, response.json()
    finally:
        connections.close_all()


def as_admin(token: str, path: str) -> Any:
    """A GET of the tenant's API as its admin (from a worker thread: its connection is closed after)."""
    try:
        return Client().get(path, HTTP_HOST=HOST, HTTP_AUTHORIZATION=f"Bearer {token}")
    finally:
        connections.close_all()


def mint(token: str, name: str, seconds: float = 600) -> tuple[int, dict[str, Any]]:
    return post(token, f"/agents/v1/cloud/instances/{name}/token/", {"seconds": seconds})


def report(token: str, *instances: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return post(token, "/agents/v1/cloud/instances/", {"instances": list(instances)})


def schedule(fleet: dict[str, Any]) -> None:
    try:
        with schema_context("fleet"):
            run_cycle(fleet["tenant"])
    finally:
        connections.close_all()


async def scaler_takes(client: Any, count: int) -> list[dict[str, Any]]:
    """The autoscaler connects, says hello and accepts `count` assignments."""
    assert (await client.connect())[0]
    await client.send_json_to(hello("scaler"))
    await receive(client, "welcome")
    assigns = [await receive(client, "assign") for _ in range(count)]
    for assign in assigns:
        await client.send_json_to({"type": "accepted", **run_of(assign)})
    await asyncio.sleep(0.3)
    return assigns


async def scaler_with_both(clouded: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """The autoscaler connected (so its pool is online), the pool scheduled, both tasks assigned to it and
    accepted: the autoscaler's client and the two assignments."""
    scaler = agent(clouded["scaler"])
    assert (await scaler.connect())[0]
    await scaler.send_json_to(hello("scaler"))
    await receive(scaler, "welcome")
    await asyncio.to_thread(schedule, clouded)
    await scaler.send_json_to({"type": "heartbeat", "held": []})
    assigns = [await receive(scaler, "assign") for _ in range(2)]
    for assign in assigns:
        await scaler.send_json_to({"type": "accepted", **run_of(assign)})
    await asyncio.sleep(0.3)
    return scaler, assigns


@pytest.mark.django_db(transaction=True)
def test_a_cloud_pool_is_online_through_its_autoscaler_with_no_instance(clouded: dict[str, Any]) -> None:
    schedule(clouded)
    with schema_context("fleet"):
        assert set(Task.objects.filter(pk__in=clouded["tasks"]).values_list("state", flat=True)) == {"queued"}
        assert Task.objects.get(pk=clouded["tasks"][0]).reason_code == "no_pool_can_hold"
    connections.close_all()

    async def connect() -> None:
        client = agent(clouded["scaler"])
        assert (await client.connect())[0]
        await client.send_json_to(hello("scaler"))
        await receive(client, "welcome")
        await client.disconnect()

    asyncio.run(connect())
    schedule(clouded)
    with schema_context("fleet"):
        assert set(Task.objects.filter(pk__in=clouded["tasks"]).values_list("state", flat=True)) == {"placed"}
    connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_only_a_connected_cloud_autoscaler_may_mint_and_an_instance_token_serves_its_own_agent(
    clouded: dict[str, Any],
) -> None:
    assert mint(clouded["scaler"], "scaler-aa11")[0] == 403  # it has not said hello: its token is unbound
    assert mint(clouded["token"].secret, "x-1")[0] == 403  # the agent of a Kubernetes pool starts nothing

    async def scenario() -> None:
        scaler = agent(clouded["scaler"])
        await scaler_takes(scaler, 0)
        status, minted = await asyncio.to_thread(mint, clouded["scaler"], "scaler-aa11")
        assert status == 201, minted
        token = cloud.Minted.parse(minted).token
        # The instance's token cannot act for the autoscaler ...
        assert (await asyncio.to_thread(mint, token, "scaler-bb22"))[0] == 403
        assert (await asyncio.to_thread(report, token))[0] == 403
        # ... nor serve another agent than the instance it was minted for.
        stranger = agent(token)
        assert (await stranger.connect())[0]
        await stranger.send_json_to(hello("somebody-else", backend="baremetal"))
        refused = await stranger.receive_output(timeout=10)
        assert refused["type"] == "websocket.send"
        assert "bound to agent scaler-aa11" in refused["text"]
        await stranger.disconnect()
        instance = agent(token)
        assert (await instance.connect())[0]
        await instance.send_json_to(hello("scaler-aa11", backend="baremetal"))
        assert (await receive(instance, "welcome"))["type"] == "welcome"
        await instance.disconnect()
        # A name of another autoscaler's or pool's instance, or a bad one, is refused.
        for name in ("rack-1", "UPPER", "a_b", "x" * 64):
            status, _ = await asyncio.to_thread(mint, clouded["scaler"], name)
            assert status in (404, 409), name
        await scaler.disconnect()

    with schema_context("fleet"):
        from apps.fleet.models import Agent

        Agent.objects.create(id="rack-1", pool=Pool.objects.get(name="h100"), backend="baremetal")
    connections.close_all()
    asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_an_instance_token_not_used_before_its_deadline_is_refused(clouded: dict[str, Any]) -> None:
    async def scenario() -> None:
        scaler = agent(clouded["scaler"])
        await scaler_takes(scaler, 0)
        token = cloud.Minted.parse((await asyncio.to_thread(mint, clouded["scaler"], "late-1", 60))[1]).token
        await in_fleet(
            lambda: AgentToken.objects.filter(bound_agent_id="late-1").update(
                expires_at=timezone.now() - timedelta(seconds=1)
            )
        )
        late = agent(token)
        assert (await late.connect())[0]
        said = json.loads((await late.receive_output(timeout=10))["text"])
        assert "was good for its instance's first connection until" in said["detail"]
        await scaler.disconnect()

    asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_a_handoff_is_fenced_by_its_lease_and_the_instance_agent_gets_exactly_its_runs(
    clouded: dict[str, Any],
) -> None:
    async def scenario() -> None:
        scaler, (first, second) = await scaler_with_both(clouded)
        token = cloud.Minted.parse((await asyncio.to_thread(mint, clouded["scaler"], "scaler-0001"))[1]).token
        await asyncio.to_thread(mint, clouded["scaler"], "scaler-0002")

        # Refused: a wrong lease, an instance not minted, an ended instance, a malformed body.
        wrong = {"task_id": first["task_id"], "lease_id": second["lease_id"], "agent_id": "scaler-0001",
                 "patience_seconds": 60}  # fmt: skip
        assert (await asyncio.to_thread(post, clouded["scaler"], "/agents/v1/cloud/handoff/", wrong))[
            0
        ] == 409
        nowhere = {**run_of(first), "agent_id": "scaler-9999", "patience_seconds": 60}
        assert (await asyncio.to_thread(post, clouded["scaler"], "/agents/v1/cloud/handoff/", nowhere))[
            0
        ] == 409
        bad_bodies: list[object] = [
            {**run_of(first)},
            {**run_of(first), "agent_id": "a", "patience_seconds": 0},
            [],
        ]
        for bad in bad_bodies:
            assert (await asyncio.to_thread(post, clouded["scaler"], "/agents/v1/cloud/handoff/", bad))[
                0
            ] == 400

        # Handed on: the autoscaler's run ends, a new run under a new lease waits for the instance's agent.
        body = {**run_of(first), "agent_id": "scaler-0001", "patience_seconds": 300}
        status, answer = await asyncio.to_thread(post, clouded["scaler"], "/agents/v1/cloud/handoff/", body)
        assert status == 200, answer
        handed = cloud.Handed.parse(answer)
        assert handed.lease_id != first["lease_id"]
        again = await asyncio.to_thread(post, clouded["scaler"], "/agents/v1/cloud/handoff/", body)
        assert again[0] == 409  # the old lease is spent: a repeat hands nothing twice

        # The autoscaler's late report under the old lease is stale; the instance's agent gets the new run
        # only (not the second task, which is still the autoscaler's), and again after a reconnect until it
        # accepts it.
        await scaler.send_json_to({"type": "status", **run_of(first), "seq": 1, "state": "pending"})
        assert (await receive(scaler, "ack"))["verdict"] == "stale"
        for _ in range(2):
            instance = agent(token)
            assert (await instance.connect())[0]
            await instance.send_json_to(hello("scaler-0001", backend="baremetal"))
            await receive(instance, "welcome")
            assign = await receive(instance, "assign")
            assert (assign["task_id"], assign["lease_id"]) == (first["task_id"], handed.lease_id)
            assert await instance.receive_nothing(timeout=0.5)
            await instance.disconnect()
        instance = agent(token)
        assert (await instance.connect())[0]
        await instance.send_json_to(hello("scaler-0001", backend="baremetal"))
        await receive(instance, "welcome")
        assign = await receive(instance, "assign")
        await instance.send_json_to({"type": "accepted", **run_of(assign)})
        await instance.send_json_to({"type": "status", **run_of(assign), "seq": 1, "state": "running"})
        assert (await receive(instance, "ack"))["verdict"] == "applied"

        # The plane's view for the autoscaler: the instance connected, with that run on it.
        status, view = await asyncio.to_thread(report, clouded["scaler"])
        fleet = cloud.FleetView.parse(view)
        on = {agent_.agent_id: agent_ for agent_ in fleet.agents}
        assert on["scaler-0001"].connected
        assert not on["scaler-0002"].connected
        assert [(run.task_id, run.lease_id) for run in on["scaler-0001"].runs] == [
            (first["task_id"], handed.lease_id)
        ]
        await instance.disconnect()
        await scaler.disconnect()
        handed_task.append(first["task_id"])

    handed_task: list[str] = []
    asyncio.run(scenario())
    with schema_context("fleet"):
        runs = list(TaskRun.objects.filter(task_id=handed_task[0]).order_by("attempt"))
        assert [(run.agent_id, run.outcome) for run in runs] == [
            ("scaler", RunOutcome.HANDED),
            ("scaler-0001", RunOutcome.LIVE),
        ]
        assert Task.objects.get(pk=handed_task[0]).state == TaskState.RUNNING
    connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_an_instance_the_cloud_takes_back_puts_its_work_back_at_the_front_as_preempted(
    clouded: dict[str, Any],
) -> None:
    async def scenario() -> None:
        scaler, (first, _) = await scaler_with_both(clouded)
        token = cloud.Minted.parse((await asyncio.to_thread(mint, clouded["scaler"], "spot-0001"))[1]).token
        body = {**run_of(first), "agent_id": "spot-0001", "patience_seconds": 300}
        await asyncio.to_thread(post, clouded["scaler"], "/agents/v1/cloud/handoff/", body)
        instance = agent(token)
        assert (await instance.connect())[0]
        await instance.send_json_to(hello("spot-0001", backend="baremetal"))
        await receive(instance, "welcome")
        assign = await receive(instance, "assign")
        await instance.send_json_to({"type": "accepted", **run_of(assign)})
        await instance.send_json_to({"type": "status", **run_of(assign), "seq": 1, "state": "running"})
        await receive(instance, "ack")
        notice = {"name": "spot-0001", "state": "interrupted", "instance_type": "g5.xlarge", "spot": True,
                  "reason": "Server.SpotInstanceTermination: Spot instance termination"}  # fmt: skip
        status, _ = await asyncio.to_thread(report, clouded["scaler"], notice)
        assert status == 200
        assert (await asyncio.to_thread(report, clouded["scaler"], notice))[
            0
        ] == 200  # repeated: nothing more
        # The instance's agent is told to stop it with the grace period to checkpoint, then let go.
        stop = await receive(instance, "preempt")
        assert (stop["task_id"], stop["lease_id"], stop["grace_seconds"]) == (
            assign["task_id"], assign["lease_id"], 30.0,
        )  # fmt: skip
        await scaler.disconnect()
        interrupted.append(first["task_id"])

    interrupted: list[str] = []
    asyncio.run(scenario())
    with schema_context("fleet"):
        task = Task.objects.get(pk=interrupted[0])
        (other,) = [pk for pk in clouded["tasks"] if pk != interrupted[0]]
        assert task.state == TaskState.QUEUED
        assert task.reason_code == "preempted"
        assert "the cloud took back instance spot-0001" in task.reason
        assert "SpotInstanceTermination" in task.reason
        states = list(TaskEvent.objects.filter(task=task).values_list("to_state", flat=True))
        assert states[-2:] == [TaskState.PREEMPTED, TaskState.QUEUED]
        assert task.submitted_at == Task.objects.get(pk=task.pk).submitted_at
        assert Task.objects.get(pk=other).state == TaskState.DISPATCHING  # the autoscaler's, untouched
        instance = CloudInstance.objects.get(pk="spot-0001")
        assert instance.state == cloud.INTERRUPTED
        assert instance.ended_at is not None
        assert AgentToken.objects.filter(bound_agent_id="spot-0001").get().revoked_at is not None
    connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_an_instances_life_is_metered_busy_and_idle_at_its_types_price_into_chargeback(
    clouded: dict[str, Any],
) -> None:
    """Booting 30 minutes, running work an hour, idle 15 minutes, then ended: its time reaches the ledger as
    its kinds (idle and instance) at the price book's hourly price, once, and the chargeback file shows it
    beside the GPU-hours."""
    from apps.metering.exports import chargeback
    from apps.metering.models import LedgerEvent
    from apps.metering.services import price_book_save

    with schema_context("fleet"):
        price_book_save(
            gpu_hour={}, tokens_million={}, gb_month="0", instance_hour={"g5.xlarge": "1.2", "*": "9"}
        )
    connections.close_all()

    def back(minutes: int) -> None:
        """As if the instance's last metering were `minutes` ago."""
        with schema_context("fleet"):
            instance = CloudInstance.objects.get(pk="life-0001")
            assert instance.metered_until is not None
            CloudInstance.objects.filter(pk="life-0001").update(
                metered_until=instance.metered_until - timedelta(minutes=minutes)
            )
        connections.close_all()

    def state(name: str) -> dict[str, Any]:
        return {
            "name": "life-0001",
            "state": name,
            "instance_type": "g5.xlarge",
            "gpus": 1,
            "region": "us-east-1",
        }

    async def scenario() -> None:
        scaler = agent(clouded["scaler"])
        await scaler_takes(scaler, 0)
        await asyncio.to_thread(mint, clouded["scaler"], "life-0001")
        await scaler.disconnect()

    asyncio.run(scenario())
    assert report(clouded["scaler"], state("launching"))[0] == 200
    assert report(clouded["scaler"], state("booting"))[0] == 200
    back(30)
    report(clouded["scaler"], state("busy"))
    back(60)
    report(clouded["scaler"], state("idle"))
    back(15)
    report(clouded["scaler"], state("stopped"))
    report(clouded["scaler"], state("stopped"))  # a repeated report after the end meters nothing more
    with schema_context("fleet"):
        events = list(LedgerEvent.objects.filter(kind__in=("instance", "idle")).order_by("ended_at"))
        assert [(event.kind, event.instance_ms // 60_000) for event in events] == [
            ("idle", 30), ("instance", 60), ("idle", 15),
        ]  # fmt: skip
        # 1.2 USD an hour, to the nano-USD, of the time each stretch lasted (30, 60 and 15 minutes)
        assert [event.cost_nano_usd for event in events] == [
            (event.instance_ms * 12 * 10**8 + 1_800_000) // 3_600_000 for event in events
        ]
        assert [round(event.cost_nano_usd / 10**7) for event in events] == [60, 120, 30]  # cents
        assert {(event.pool, event.gpu_class, event.instance_type, event.user_id) for event in events} == {
            ("spot-a10", "A10G", "g5.xlarge", None)
        }
        rows = {row["kind"]: row for row in chargeback(events[0].period)}
        assert rows["idle"]["instance_hours"].quantize(Decimal("0.01")) == Decimal("0.75")
        assert rows["idle"]["cost_usd"].quantize(Decimal("0.01")) == Decimal("0.90")
        assert rows["instance"]["instance_hours"].quantize(Decimal("0.01")) == Decimal("1.00")
        assert (rows["instance"]["pool"], rows["instance"]["instance_type"]) == ("spot-a10", "g5.xlarge")
        assert rows["instance"]["cost_center"] == rows["instance"]["project"] == ""
    connections.close_all()
    # Administrators see each instance, its state and this month's busy and idle time and cost.
    admin = clouded["admin_token"]
    assert as_admin(admin, "/api/v1/instances/").json()["results"] == []  # ended: not live
    (listed,) = as_admin(admin, "/api/v1/instances/?all=true&pool=spot-a10").json()["results"]
    assert (listed["name"], listed["state"], listed["instance_type"]) == ("life-0001", "stopped", "g5.xlarge")
    assert Decimal(listed["month"]["idle_cost_usd"]).quantize(Decimal("0.01")) == Decimal("0.90")
    assert Decimal(listed["month"]["busy_hours"]).quantize(Decimal("0.01")) == Decimal("1.00")
    assert as_admin(admin, "/api/v1/instances/?pool=nowhere").status_code == 404
    connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_an_autoscaler_cannot_end_or_impersonate_agents_that_are_not_its_instances(
    clouded: dict[str, Any],
) -> None:
    """Names of other agents (of another pool, or the autoscaler's own) are refused for instances, and a
    report that one of them was interrupted touches none of its work."""
    from tests.fleet.test_fencing import start

    async def scenario() -> None:
        rack = agent(clouded["token"].secret)
        await start(rack, "rack-1")  # the h100 pool's agent runs the fleet's task
        scaler = agent(clouded["scaler"])
        await scaler_takes(scaler, 0)
        for name in ("rack-1", "scaler"):
            status, said = await asyncio.to_thread(mint, clouded["scaler"], name)
            assert status == 409, said
            assert "Another agent is called" in said["detail"]
        forged = {"name": "rack-1", "state": "interrupted", "reason": "forged"}
        assert (await asyncio.to_thread(report, clouded["scaler"], forged))[0] == 200
        await scaler.disconnect()
        await rack.disconnect()

    asyncio.run(scenario())
    with schema_context("fleet"):
        assert Task.objects.get(pk=clouded["task"]).state == TaskState.RUNNING
        assert not CloudInstance.objects.filter(pk="rack-1").exists()
    connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_an_autoscaler_that_cannot_start_instances_takes_its_pool_out_of_placement_and_says_why(
    clouded: dict[str, Any],
) -> None:
    problem = (
        "EC2 refused to start a g5.xlarge instance: AuthFailure: AWS was not able to validate the credentials"
    )

    async def connect() -> Any:
        client = agent(clouded["scaler"])
        assert (await client.connect())[0]
        await client.send_json_to({**hello("scaler"), "problem": problem})
        await receive(client, "welcome")
        return client

    async def scenario() -> None:
        client = await connect()
        await asyncio.to_thread(schedule, clouded)
        with_problem = await in_fleet(lambda: list(Task.objects.filter(pk__in=clouded["tasks"])))
        assert {task.state for task in with_problem} == {TaskState.QUEUED}  # not placed where nothing starts
        listing = await asyncio.to_thread(as_admin, clouded["admin_token"], "/api/v1/pools/")
        pools = listing.json()["results"]
        (cloud_pool,) = [pool for pool in pools if pool["name"] == "spot-a10"]
        assert cloud_pool["problems"] == [f"scaler: {problem}"]  # the pool's status says which, and why
        # Fixed: its next heartbeat says no problem, and the pool takes work again.
        await client.send_json_to({"type": "heartbeat", "held": [], "problem": ""})
        await asyncio.sleep(0.5)
        await asyncio.to_thread(schedule, clouded)
        fixed = await in_fleet(lambda: list(Task.objects.filter(pk__in=clouded["tasks"])))
        assert {task.state for task in fixed} <= {TaskState.PLACED, TaskState.DISPATCHING}
        await client.disconnect()

    asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_an_autoscaler_in_another_region_than_its_pool_takes_no_work(clouded: dict[str, Any]) -> None:
    async def scenario() -> None:
        client = agent(clouded["scaler"])
        assert (await client.connect())[0]
        await client.send_json_to({**hello("scaler"), "inventory": {"region": "eu-west-1"}})
        await receive(client, "welcome")
        await client.send_json_to({"type": "heartbeat", "held": [], "problem": ""})  # it sees no problem
        await asyncio.sleep(0.5)
        await asyncio.to_thread(schedule, clouded)
        tasks = await in_fleet(lambda: list(Task.objects.filter(pk__in=clouded["tasks"])))
        assert {task.state for task in tasks} == {TaskState.QUEUED}
        listing = await asyncio.to_thread(as_admin, clouded["admin_token"], "/api/v1/pools/")
        (cloud_pool,) = [pool for pool in listing.json()["results"] if pool["name"] == "spot-a10"]
        (problem,) = cloud_pool["problems"]
        assert "starts instances in region eu-west-1, but pool spot-a10 is in us-east-1" in problem
        await client.disconnect()

    asyncio.run(scenario())


@pytest.mark.django_db(transaction=True)
def test_an_autoscaler_away_loses_only_what_it_held_not_the_work_on_live_instances(
    clouded: dict[str, Any],
) -> None:
    """The autoscaler is killed and stays away past the pool's timeout: the task waiting in it is given up
    (queued again), while the task running on an instance whose agent still heartbeats runs on, not run
    twice."""
    from apps.fleet.models import Agent

    async def scenario() -> None:
        scaler, (first, second) = await scaler_with_both(clouded)
        token = cloud.Minted.parse((await asyncio.to_thread(mint, clouded["scaler"], "live-0001"))[1]).token
        body = {**run_of(first), "agent_id": "live-0001", "patience_seconds": 300}
        await asyncio.to_thread(post, clouded["scaler"], "/agents/v1/cloud/handoff/", body)
        instance = agent(token)
        assert (await instance.connect())[0]
        await instance.send_json_to(hello("live-0001", backend="baremetal"))
        await receive(instance, "welcome")
        assign = await receive(instance, "assign")
        await instance.send_json_to({"type": "accepted", **run_of(assign)})
        await instance.send_json_to({"type": "status", **run_of(assign), "seq": 1, "state": "running"})
        await receive(instance, "ack")
        await scaler.disconnect()  # killed: it says nothing more
        long_ago = timezone.now() - timedelta(minutes=10)
        await in_fleet(lambda: Pool.objects.filter(name="spot-a10").update(last_heartbeat_at=long_ago))
        await in_fleet(lambda: Agent.objects.filter(pk="scaler").update(last_heartbeat_at=long_ago))
        await instance.send_json_to({"type": "heartbeat", "held": [run_of(assign)]})
        await asyncio.sleep(0.5)
        await asyncio.to_thread(schedule, clouded)
        running = await in_fleet(lambda: Task.objects.get(pk=first["task_id"]))
        waiting = await in_fleet(lambda: Task.objects.get(pk=second["task_id"]))
        assert running.state == TaskState.RUNNING  # on the live instance, untouched
        assert waiting.state == TaskState.QUEUED  # the autoscaler's own run was lost with it
        lost = await in_fleet(lambda: TaskEvent.objects.filter(task_id=second["task_id"]).last())
        assert "its agent went silent" in lost.message
        await instance.disconnect()

    asyncio.run(scenario())
