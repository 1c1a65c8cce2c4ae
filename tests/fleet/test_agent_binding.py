"""An agent token is bound to the agent that first says hello with it: a copy used by another agent (or
the same id without its instance key) is refused, audited and shown to the pool's admins."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.db import connections
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.audit.models import AuditEvent
from apps.fleet.models import AgentToken
from tests.fleet.conftest import HOST, agent


async def _hello(token: str, agent_id: str, instance: str) -> tuple[dict[str, Any], Any]:
    client = agent(token)
    await client.connect()
    await client.send_json_to(
        {"type": "hello", "protocol": 2, "agent_id": agent_id, "instance": instance, "held": []}
    )
    reply: dict[str, Any] = await client.receive_json_from(timeout=10)
    closed = await client.receive_output(timeout=5) if reply["type"] == "error" else None
    await client.disconnect()
    return reply, closed


@pytest.mark.parametrize(
    ("agent_id", "instance"),
    [("rack-9", "key-of-rack-1"), ("rack-1", "another-key"), ("rack-1", ""), ("RACK-1", "key-of-rack-1")],
)
def test_a_copied_token_is_refused_audited_and_shown(
    fleet: dict[str, Any], agent_id: str, instance: str
) -> None:
    token = fleet["other"]  # the baremetal pool's: nothing is dispatched on hello
    first, _ = asyncio.run(_hello(token.secret, "rack-1", "key-of-rack-1"))
    assert first["type"] == "welcome"
    again, _ = asyncio.run(_hello(token.secret, "rack-1", "key-of-rack-1"))  # the same agent, reconnecting
    assert again["type"] == "welcome"
    copied, closed = asyncio.run(_hello(token.secret, agent_id, instance))
    assert copied["type"] == "error"
    assert "is bound to agent rack-1" in copied["detail"]
    assert closed == {"type": "websocket.close", "code": 4403}
    with schema_context("fleet"):
        kept = AgentToken.objects.get(pk=token.token.pk)
        assert kept.bound_agent_id == "rack-1"
        assert kept.conflict_at is not None
        assert f"agent {agent_id} " in kept.conflict
        assert AuditEvent.objects.filter(action="agent_token.conflict").count() == 1
    connections.close_all()
    admin = APIClient()
    admin.credentials(HTTP_AUTHORIZATION=f"Bearer {fleet['admin_token']}", HTTP_HOST=HOST)
    with schema_context("fleet"):
        pool_id = kept.pool_id
    rows = admin.get(f"/api/v1/pools/{pool_id}/agent-tokens/").json()["results"]
    [row] = [row for row in rows if row["id"] == str(token.token.pk)]
    assert row["bound_agent_id"] == "rack-1"
    assert row["conflict"].startswith(f"agent {agent_id}")
    connections.close_all()
