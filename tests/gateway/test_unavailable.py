"""When a store the gateway needs does not answer, a call gets a 503 in OpenAI's format, not a bare 500."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway import app as gateway_app
from tests.world import HOST_A, World

pytestmark = pytest.mark.django_db


def test_redis_down_is_a_503_that_says_so(world: World, monkeypatch: Any) -> None:
    import redis.asyncio

    monkeypatch.setattr(
        gateway_app, "async_redis", lambda: redis.asyncio.Redis.from_url("redis://127.0.0.1:1/0")
    )

    async def call() -> httpx.Response:
        application: Any = gateway_app.GatewayApp()
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{HOST_A}") as client:
            return await client.get("/v1/models", headers={"Authorization": f"Bearer {world.tokens['bob']}"})

    response = asyncio.run(call())
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    error = response.json()["error"]
    assert error["type"] == "api_error"
    assert error["message"] == "The gateway could not reach Redis; nothing was spent. Try again shortly."
