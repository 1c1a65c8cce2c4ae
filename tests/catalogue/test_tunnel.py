"""An app's tunnel is fenced like every report: only the agent that runs the app's live run, presenting its
own token and instance key, opens it; the route's frames reach that agent and its answers come back."""

from __future__ import annotations

import asyncio
from typing import Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.db import connections
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.catalogue import services
from apps.catalogue.models import AppInstance
from apps.catalogue.tunnel import TunnelConsumer
from apps.core.tunnels import ACCEPTED, DROPPED
from apps.scheduling.cycle import run_cycle
from config.asgi import application
from protocol import tunnel
from tests.fleet.conftest import HOST, agent
from tests.fleet.test_fencing import receive, run_of

INSTANCE = "instance-key-1"


def launch_app(fleet: dict[str, Any]) -> str:
    with schema_context("fleet"):
        fay = User.objects.get(username="fay")
        services.entry_add(
            user=fay, document={"name": "web", "version": "1", "command": ["web", "{port}"], "gpus": "4"}
        )
        app = services.app_launch(
            tenant=fleet["tenant"], user=fay, entry="web", compute_resource="Research: 4 GPUs"
        )
        run_cycle(fleet["tenant"])
    connections.close_all()
    return str(app.task_id)


def tunnel_client(token: str, task_id: str, lease_id: str, instance: str = INSTANCE) -> WebsocketCommunicator:
    headers = {"host": HOST, "authorization": f"Bearer {token}", "x-klique-instance": instance}
    headers |= {"x-klique-task": task_id, "x-klique-lease": lease_id}
    return WebsocketCommunicator(
        application, "/agents/tunnel/", headers=[(k.encode(), v.encode()) for k, v in headers.items()]
    )


async def closed_with(client: WebsocketCommunicator) -> int | None:
    """The close code the plane answered with, or None while it keeps the tunnel open."""
    await client.connect()
    try:
        output = await client.receive_output(timeout=3)
    except TimeoutError:
        await client.disconnect()
        return None
    return int(output["code"]) if output["type"] == "websocket.close" else None


async def running_agent(
    fleet: dict[str, Any], app_task: str
) -> tuple[WebsocketCommunicator, dict[str, dict[str, Any]]]:
    client = agent(fleet["token"].secret)
    assert (await client.connect())[0]
    await client.send_json_to({"type": "hello", "protocol": 2, "agent_id": "rack-1", "backend": "baremetal",
                               "instance": INSTANCE, "held": []})  # fmt: skip
    await receive(client, "welcome")
    assigns = {assign["task_id"]: assign for assign in [await receive(client, "assign") for _ in range(2)]}
    for assign in assigns.values():
        await client.send_json_to({"type": "accepted", **run_of(assign)})
        await client.send_json_to({"type": "status", **run_of(assign), "seq": 1, "state": "running"})
        assert (await receive(client, "ack"))["verdict"] == "applied"
    assert app_task in assigns
    return client, assigns


def test_only_the_live_run_of_an_app_by_its_own_agent_opens_a_tunnel(fleet: dict[str, Any]) -> None:
    app_task = launch_app(fleet)

    async def scenario() -> dict[str, Any]:
        client, assigns = await running_agent(fleet, app_task)
        lease, plain = assigns[app_task]["lease_id"], fleet["task"]
        codes = {
            "another run's lease": await closed_with(
                tunnel_client(fleet["token"].secret, app_task, "0" * 32)
            ),
            "no lease": await closed_with(tunnel_client(fleet["token"].secret, app_task, "")),
            "a task that is no app": await closed_with(
                tunnel_client(fleet["token"].secret, plain, assigns[plain]["lease_id"])
            ),
            "a copy of the token": await closed_with(
                tunnel_client(fleet["token"].secret, app_task, lease, instance="stolen")
            ),
            "another pool's token": await closed_with(tunnel_client(fleet["other"].secret, app_task, lease)),
            "a forged token": await closed_with(tunnel_client("kqa_xxxxxxxx_yyyy", app_task, lease)),
        }
        opened = tunnel_client(fleet["token"].secret, app_task, lease)
        assert (await opened.connect())[0]
        relayed = await relay(opened, app_task)
        await opened.disconnect()
        # The run ends: its lease opens no tunnel any more.
        await client.send_json_to(
            {"type": "result", "task_id": app_task, "lease_id": lease, "seq": 2, "exit_code": 0}
        )
        await receive(client, "ack")
        codes["an ended run"] = await closed_with(tunnel_client(fleet["token"].secret, app_task, lease))
        await client.disconnect()
        return {"codes": codes, **relayed}

    seen = asyncio.run(scenario())
    assert seen["codes"] == {
        "another run's lease": 4404, "no lease": 4404, "a task that is no app": 4404, "an ended run": 4404,
        "a copy of the token": 4401, "another pool's token": 4401, "a forged token": 4401,
    }  # fmt: skip
    assert seen["open"] == {"method": "GET", "target": "/x?y=1", "headers": [["x-a", "1"]]}
    assert seen["answer"] == [
        (ACCEPTED, b""),
        (tunnel.HEAD, b'{"status": 200}'),
        (tunnel.DATA, b"hi"),
        (tunnel.END, b""),
    ]
    assert seen["channel"] == ""  # the tunnel closed: the route no longer sends there


async def relay(opened: WebsocketCommunicator, app_task: str) -> dict[str, Any]:
    """A request as the route sends it, through the plane's end of the tunnel to the 'agent' and back."""

    def app_row() -> AppInstance:
        with schema_context("fleet"):
            return AppInstance.objects.get(task_id=app_task)

    row = await sync_to_async(app_row)()
    layer = get_channel_layer()
    reply = await layer.new_channel("route.")
    head = {"method": "GET", "target": "/x?y=1", "headers": [["x-a", "1"]]}
    await layer.send(row.tunnel_channel, {"type": "tunnel.open", "reply": reply, "head": head})
    opening = tunnel.Frame.decode(await opened.receive_from(timeout=5))
    assert opening.kind == tunnel.OPEN
    for kind, payload in ((tunnel.HEAD, b'{"status": 200}'), (tunnel.DATA, b"hi"), (tunnel.END, b"")):
        await opened.send_to(bytes_data=tunnel.Frame(opening.stream, kind, payload).encode())
    answer = []
    for _ in range(4):
        message = await asyncio.wait_for(layer.receive(reply), 5)
        answer.append((message["kind"], bytes(message["payload"])))
    await opened.disconnect()
    await asyncio.sleep(0.2)
    row = await sync_to_async(app_row)()
    return {"open": opening.document(), "answer": answer, "channel": row.tunnel_channel}


def test_a_frame_for_an_agent_whose_socket_is_gone_resets_the_route_at_once() -> None:
    """The agent killed a moment ago, its close not seen yet: the route is told now, not after minutes."""

    class Layer:
        def __init__(self) -> None:
            self.sent: list[tuple[str, dict[str, Any]]] = []

        async def send(self, channel: str, message: dict[str, Any]) -> None:
            self.sent.append((channel, message))

    class Gone(TunnelConsumer):
        async def send(
            self, text_data: str | None = None, bytes_data: bytes | None = None, close: bool = False
        ) -> None:
            raise ConnectionResetError("the agent's socket is closed")

    consumer = Gone()
    layer = Layer()
    consumer.channel_layer = layer
    consumer.streams, consumer.by_reply, consumer.ended, consumer.next_stream = {}, {}, {}, 1

    async def scenario() -> None:
        await consumer.tunnel_open({"reply": "route.1", "head": {"method": "GET", "target": "/"}})
        await consumer.tunnel_frame({"reply": "route.1", "kind": tunnel.DATA, "payload": b"x"})

    asyncio.run(scenario())
    kinds = [(channel, message["kind"], message["payload"]) for channel, message in layer.sent]
    assert kinds == [("route.1", ACCEPTED, b""), ("route.1", tunnel.RESET, DROPPED)]
    assert consumer.streams == {}
    assert consumer.by_reply == {}
