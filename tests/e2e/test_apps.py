"""Apps through the whole of Klique: an entry added from a template, an app launched on a real bare-metal
agent, reached through its internal route (HTTP with large bodies both ways, and a websocket), by the
people it is shared with only; a tunnel that drops comes back; a stopped app's route says so."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.e2e.conftest import ROOT, clean_environment, start_up
from tests.e2e.test_agent_crash import Demo, agent_argv
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

TEMPLATE = {
    "name": "echo-app",
    "version": "1",
    "title": "Echo",
    "command": [
        sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "tests" / "e2e"), "app_server:app",
        "--host", "127.0.0.1", "--port", "{port}", "--no-access-log", "--lifespan", "off",
    ],
    "health": {"path": "/", "startup_seconds": 60},
    "gpus": "1",
}  # fmt: skip


def wait_state(demo: Demo, app_id: str, wanted: str, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (app := demo.call("GET", f"/api/v1/apps/{app_id}/"))["state"] != wanted:
        assert time.monotonic() < deadline, app
        time.sleep(0.3)
    return app  # type: ignore[no-any-return]


class Route:
    """Requests to an app's host, sent to the plane on 127.0.0.1 with the app's host in Host."""

    def __init__(self, port: int, url: str, token: str) -> None:
        self.port, self.host = port, url.split("//", 1)[1].rstrip("/")
        self.headers = {"Host": self.host, "Authorization": f"Bearer {token}"}

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.request(
            method, f"http://127.0.0.1:{self.port}{path}", headers=headers, timeout=60, **kwargs
        )

    async def websocket_echo(self, words: list[str]) -> list[str]:
        async with websockets.connect(
            f"ws://{self.host}/ws",
            additional_headers={"Authorization": self.headers["Authorization"]},
            open_timeout=20,
            host="127.0.0.1",
            port=self.port,
        ) as socket_:
            answers = []
            for word in words:
                await socket_.send(word)
                answers.append(str(await socket_.recv()))
            return answers


def test_an_app_is_reached_through_its_route_by_those_it_is_shared_with_only(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    agent = None
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        argv = agent_argv(
            f"http://demo.localhost:{running.port}",
            demo.rack_pool_token(),
            "rack-1",
            tmp_path / "data" / "rack",
        )
        with (tmp_path / "agent.log").open("w") as log:
            agent = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        demo.call("POST", "/api/v1/catalogue/", json=TEMPLATE)
        app = demo.call(
            "POST", "/api/v1/apps/", json={"entry": "echo-app", "compute_resource": "Research: rack"}
        )
        assert app["state"] == "starting", app
        app = wait_state(demo, app["id"], "ready")
        route = Route(running.port, app["url"], demo.token)

        hello = route.get("/")
        assert hello.status_code == 200, hello.text
        assert hello.text.startswith("hello from the app, port "), hello.text

        body = bytes(range(256)) * 4096 * 3  # 3 MiB up
        echoed = route.request("POST", "/echo?x=1", content=body, headers={"X-Test": "yes"}).json()
        assert (echoed["method"], echoed["size"], echoed["query"]) == ("POST", len(body), "x=1")
        assert echoed["headers"]["x-test"] == "yes"
        assert "authorization" not in echoed["headers"]  # Klique's own credentials never reach the app

        big = route.get("/big?bytes=20000000")  # 20 MB down, through the credit window
        assert big.status_code == 200
        assert len(big.content) == 20_000_000
        assert big.content[:256] == bytes(range(256))

        assert asyncio.run(route.websocket_echo(["one", "two"])) == ["echo: one", "echo: two"]
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        code = running.interrupt()
        (tmp_path / "up.log").write_text(running.everything())  # kept with the test's folder
        assert code == 0
