"""A dispatch notice reaches every agent of a pool, and the pool's placed work goes to whichever asks
first: in one web process, one of its agents asks for it, not each of them (a pool of a hundred agents
made a hundred reads of each notice)."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.db import connections
from django_tenants.utils import schema_context

from apps.fleet import credentials, dispatch
from apps.resources.models import Pool
from apps.scheduling import wake
from tests.fleet.conftest import agent
from tests.fleet.test_fencing import hello, receive, second_task

AGENTS = ("rack-1", "rack-2", "rack-3")


def test_one_agent_of_a_process_asks_for_each_notices_work_and_once_more_for_a_later_notice(
    fleet: dict[str, Any],
) -> None:
    with schema_context("fleet"):
        pool = Pool.objects.get(name="h100")
        tokens = [fleet["token"].secret] + [
            credentials.agent_token_create(pool=pool, name=name).secret for name in AGENTS[1:]
        ]
    connections.close_all()
    group = wake.pool_group("fleet", pool.pk)
    asked: list[str] = []
    real = dispatch.dispatch

    def counted(**arguments: Any) -> list[dict[str, Any]]:
        asked.append(arguments["agent_id"])
        return real(**arguments)

    async def assigns(clients: list[Any]) -> dict[str, str]:
        """The assignments the agents got, by task: which agent got each."""
        await asyncio.sleep(0.5)
        got = {}
        for name, client in zip(AGENTS, clients, strict=True):
            while not await client.receive_nothing(timeout=0.2):
                message = await client.receive_json_from(timeout=5)
                if message["type"] == "assign":
                    got[message["task_id"]] = name
        return got

    async def notice(name: str) -> None:
        message = {"type": "plane.message", "message": {"type": "dispatch"}, "notice": name}
        await get_channel_layer().group_send(group, message)

    async def scenario() -> tuple[dict[str, str], list[str], dict[str, str], list[str]]:
        clients = [agent(token) for token in tokens]
        for name, client in zip(AGENTS, clients, strict=True):
            assert (await client.connect())[0]
            await client.send_json_to(hello(name))
            await receive(client, "welcome")
        await assigns(clients)  # the fixture's placed task, to the first at its hello
        with mock.patch.object(wake, "notify_pool"):  # the cycle's own notice: this test sends its own
            placed = await sync_to_async(second_task)(fleet)
        with mock.patch.object(dispatch, "dispatch", side_effect=counted):
            await notice("one")
            first = await assigns(clients)
            first_asked = list(asked)
            asked.clear()
            await notice("two")  # nothing placed since: one more look, by one agent
            second = await assigns(clients)
        for client in clients:
            await client.disconnect()
        assert list(first) == [placed]
        return first, first_asked, second, list(asked)

    first, first_asked, second, second_asked = asyncio.run(scenario())
    assert len(first_asked) == 1  # three agents told, one asked
    assert list(first.values()) == first_asked  # and it is the one that got the task
    assert second == {}
    assert len(second_asked) == 1
