"""Apps through the whole of Klique: an entry added from a template, an app launched on a real bare-metal
agent, reached through its internal route (HTTP with large bodies both ways, and a websocket), by the
people it is shared with only; a tunnel that drops comes back, and a websocket through it survives the drop;
a stopped app's route says so."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from typing import Any

import httpx
import pytest
import websockets

from tests.e2e.conftest import ROOT, RackDemo
from tests.e2e.cut_proxy import CutProxy
from tests.e2e.test_agent_crash import Demo

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

    def declared_too_large(self, size: int) -> bytes:
        """The first line of the answer to a POST that declares `size` bytes and sends a few."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as raw:
            head = f"POST /echo HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {size}\r\n"
            raw.sendall(f"{head}Authorization: {self.headers['Authorization']}\r\n\r\n".encode() + b"x" * 100)
            return raw.recv(200).split(b"\r\n")[0] + b"\r\n"

    def websocket(self) -> Any:
        """A websocket to the app's /ws (an echo), through the route."""
        return websockets.connect(
            f"ws://{self.host}/ws",
            additional_headers={"Authorization": self.headers["Authorization"]},
            open_timeout=20,
            host="127.0.0.1",
            port=self.port,
        )

    async def websocket_echo(self, words: list[str]) -> list[str]:
        async with self.websocket() as socket_:
            answers = []
            for word in words:
                await socket_.send(word)
                answers.append(str(await socket_.recv()))
                await socket_.send(word.encode() + b"\x00\xff")  # and as a binary message
                assert await socket_.recv() == word.encode() + b"\x00\xff"
            return answers


def test_an_app_is_reached_through_its_route_by_those_it_is_shared_with_only(rack_demo: RackDemo) -> None:
    demo, running = rack_demo.demo, rack_demo.running
    demo.call("POST", "/api/v1/catalogue/", json=TEMPLATE)
    secret = {"scope": "user", "name": "HF_TOKEN", "value": "hf-s3cr3t-value"}
    demo.call("POST", "/api/v1/secrets/", json=secret)
    launch = {"entry": "echo-app", "compute_resource": "Research: rack", "secrets": ["HF_TOKEN"]}
    app = demo.call("POST", "/api/v1/apps/", json=launch)
    assert app["state"] == "starting", app
    app = wait_state(demo, app["id"], "ready")
    route = Route(running.port, app["url"], demo.token)

    hello = route.get("/")
    assert hello.status_code == 200, hello.text
    assert hello.text.startswith("hello from the app, port "), hello.text
    assert route.get("/env?name=HF_TOKEN").text == "hf-s3cr3t-value"  # the owner's vault secret, by name

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

    # A person the app is not shared with: 404, as for no app at all.
    stranger = demo.call("POST", "/api/v1/service-accounts/", json={"name": "stranger"})
    made = demo.call("POST", f"/api/v1/service-accounts/{stranger['id']}/tokens/", json={"name": "t"})
    refused = Route(running.port, app["url"], made["token"]).get("/")
    assert refused.status_code == 404
    assert "hello" not in refused.text
    assert (
        Route(running.port, app["url"], "klq_notareal_token00000000000000000000000").get("/").status_code
        == 401
    )

    # A declared body larger than the route passes is refused before anything reaches the app.
    assert route.declared_too_large(300 * 1024 * 1024).startswith(b"HTTP/1.1 413 ")

    # The agent killed outright: the app keeps running, its route waits for the tunnel, and the agent
    # that comes back opens it again.
    # (mid-answer: the client gets an error, not a body cut short that looks whole)
    with httpx.stream(
        "GET", f"http://127.0.0.1:{running.port}/big?bytes=2000000000", headers=route.headers, timeout=60
    ) as answer:
        chunks = answer.iter_raw()
        assert next(chunks)
        assert rack_demo.agent is not None
        rack_demo.agent.kill()
        rack_demo.agent.wait(timeout=30)
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in chunks:
                pass
    deadline = time.monotonic() + 30
    while (away := route.get("/")).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert away.status_code in (502, 503), away.text
    rack_demo.start_agent("agent-again.log")
    wait_state(demo, app["id"], "ready")
    again = route.get("/")
    assert again.text == hello.text  # the same process, on the same port
    assert asyncio.run(route.websocket_echo(["three"])) == ["echo: three"]

    # Stopped: the route says so; started again: a new task serves it.
    demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
    stopped = wait_state(demo, app["id"], "stopped")
    assert stopped["detail"].startswith("Stopped by "), stopped
    closed = route.get("/")
    assert closed.status_code == 409
    assert "is stopped" in closed.text
    started = demo.call("POST", f"/api/v1/apps/{app['id']}/start/")
    assert started["task_id"] != app["task_id"]
    wait_state(demo, app["id"], "ready")
    assert route.get("/").text.startswith("hello from the app")


BROKEN = {
    "name": "never-answers",
    "version": "1",
    "command": [sys.executable, "-c", "import time; print('warming up', flush=True); time.sleep(120)"],
    "health": {"path": "/", "startup_seconds": 3},
    "gpus": "1",
}


def test_an_app_that_never_answers_or_exits_is_stopped_with_the_reason(rack_demo: RackDemo) -> None:
    demo, running = rack_demo.demo, rack_demo.running
    demo.call("POST", "/api/v1/catalogue/", json=BROKEN)
    demo.call("POST", "/api/v1/catalogue/", json=TEMPLATE)
    silent = demo.call(
        "POST", "/api/v1/apps/", json={"entry": "never-answers", "compute_resource": "Research: rack"}
    )
    echo = demo.call(
        "POST", "/api/v1/apps/", json={"entry": "echo-app", "compute_resource": "Research: rack"}
    )

    stopped = wait_state(demo, silent["id"], "stopped")
    assert "did not answer its health check (GET / on port" in stopped["detail"], stopped
    assert "within 3 s" in stopped["detail"]
    assert "its log ends: warming up" in stopped["detail"]  # the last lines of its log

    ready = wait_state(demo, echo["id"], "ready")
    route = Route(running.port, ready["url"], demo.token)
    assert route.get("/exit").status_code == 200
    gone = wait_state(demo, echo["id"], "stopped")
    assert "exit code 3" in gone["detail"], gone
    assert route.get("/").status_code == 409


def test_a_websocket_through_the_route_survives_its_tunnel_dropping(rack_demo: RackDemo) -> None:
    """The agent reaches the plane through a proxy that cuts every connection at once, mid-conversation:
    the client's websocket stays open, and every message, both ways, arrives once and in order."""
    demo, running = rack_demo.demo, rack_demo.running
    rack_demo.stop_agent()
    proxy = CutProxy(running.port)
    try:
        plane = f"http://demo.localhost:{running.port}"
        rack_demo.argv = [
            f"http://demo.localhost:{proxy.port}" if word == plane else word for word in rack_demo.argv
        ]
        rack_demo.start_agent("agent-proxied.log")
        demo.call("POST", "/api/v1/catalogue/", json=TEMPLATE)
        app = demo.call(
            "POST", "/api/v1/apps/", json={"entry": "echo-app", "compute_resource": "Research: rack"}
        )
        app = wait_state(demo, app["id"], "ready")
        route = Route(running.port, app["url"], demo.token)

        async def talk() -> list[str]:
            async with route.websocket() as socket_:
                await socket_.send("0")
                assert await socket_.recv() == "echo: 0"
                for number in range(1, 21):
                    await socket_.send(str(number))
                proxy.cut()  # the agent's connections, its app's tunnel among them, reset at once
                for number in range(21, 41):
                    await socket_.send(str(number))
                    await asyncio.sleep(0.05)
                return [str(await asyncio.wait_for(socket_.recv(), 90)) for _ in range(40)]

        assert asyncio.run(talk()) == [f"echo: {number}" for number in range(1, 41)]
        assert proxy.cut_count >= 2  # the agent's own socket and the tunnel, at least
        log = (rack_demo.folder / "agent-proxied.log").read_text()
        assert "its tunnel closed" in log  # it did drop
        running.wait_for("a websocket of app .* moved to its agent's new tunnel", timeout=10)
    finally:
        proxy.close()
