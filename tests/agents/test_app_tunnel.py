"""The agent's side of an app: a port picked and put where the app reads it, a health check waited for
(and an app that never answers stopped with the reason and its log's last lines), a backend that cannot
serve apps refusing them."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agents import node
from agents.backend import Refused, free_port
from agents.main import Agent
from agents.tunnel import AppTunnel, tunnel_address
from protocol.apps import AppSpec
from tests.agents.test_baremetal import Recorder, backend

APP = {"instance": "0123abcd", "port": None, "health_path": "/", "startup_seconds": 2}


def app_assignment(task_id: str, command: list[str]) -> dict[str, Any]:
    spec = {"command": command, "environment": {"MODE": "x"}, "app": dict(APP)}
    return {"task_id": task_id, "lease_id": "l", "attempt": 1, "size_units": 0, "spec": spec}


def test_the_agent_picks_a_port_and_puts_it_where_the_app_reads_it(tmp_path: Path) -> None:
    agent = Agent(url="http://demo.localhost:1", token="t", backend=backend(tmp_path), agent_id="a")
    handed = agent._with_app_port(app_assignment("t1", ["serve", "--port={port}", "--bind=127.0.0.1:{port}"]))
    port = handed["spec"]["app"]["port"]
    assert 1024 <= port <= 65535
    assert handed["spec"]["command"] == ["serve", f"--port={port}", f"--bind=127.0.0.1:{port}"]
    assert handed["spec"]["environment"] == {"MODE": "x", "PORT": str(port)}
    plain = {"task_id": "t2", "spec": {"command": ["true"]}}
    assert agent._with_app_port(plain) is plain


def test_an_app_on_a_cluster_gets_its_port_on_its_node(tmp_path: Path) -> None:
    """An HPC backend's node reporter picks the port where the app runs: the agent leaves {port} to it,
    unless the template fixed one."""
    from agents.hpc import Batch

    agent = Agent(url="http://demo.localhost:1", token="t", backend=backend(tmp_path), agent_id="a")
    agent.backend = Batch.__new__(Batch)
    assigned = app_assignment("t1", ["serve", "--port={port}"])
    assert agent._with_app_port(assigned) is assigned
    assigned["spec"]["app"]["port"] = 8888
    fixed = agent._with_app_port(assigned)["spec"]
    assert (fixed["command"], fixed["environment"]["PORT"]) == (["serve", "--port=8888"], "8888")


@pytest.mark.parametrize("section", [{"instance": "x y"}, {"instance": "ab", "port": 80}, "app"])
def test_a_malformed_app_section_is_refused_for_good(tmp_path: Path, section: object) -> None:
    agent = Agent(url="http://demo.localhost:1", token="t", backend=backend(tmp_path), agent_id="a")
    assignment = app_assignment("t1", ["serve"])
    assignment["spec"]["app"] = section
    with pytest.raises(Refused) as refused:
        agent._with_app_port(assignment)
    assert refused.value.permanent


def test_a_backend_that_cannot_serve_apps_refuses_them_saying_why(tmp_path: Path) -> None:
    class Cluster:  # a backend of a kind without apps
        name = "nomad"

    agent = Agent(url="http://demo.localhost:1", token="t", backend=backend(tmp_path), agent_id="a")
    agent.backend = Cluster()  # type: ignore[assignment]
    words = "Apps run on bare-metal, HPC and Kubernetes pools; a nomad pool"
    with pytest.raises(Refused, match=words) as refused:
        agent._with_app_port(app_assignment("t1", ["serve"]))
    assert refused.value.permanent


def test_a_pool_that_is_not_kubernetes_refuses_a_clustering_service_for_good(tmp_path: Path) -> None:
    agent = Agent(url="http://demo.localhost:1", token="t", backend=backend(tmp_path), agent_id="a")
    assignment = app_assignment("t1", ["kubectl", "proxy", "--port={port}"])
    assignment["spec"]["app"] = {**assignment["spec"]["app"], "cluster": {"service": "k3k"}}
    words = "A k3k cluster is made on a Kubernetes pool's nodes; a baremetal pool cannot make one"
    with pytest.raises(Refused, match=words) as refused:
        agent._with_app_port(assignment)
    assert refused.value.permanent


def test_the_tunnel_connects_where_the_agent_does() -> None:
    assert tunnel_address("http://demo.localhost:8000") == (
        "ws://demo.localhost:8000/agents/tunnel/",
        {"host": "127.0.0.1", "port": 8000},
    )
    assert tunnel_address("https://acme.klique.example/") == ("wss://acme.klique.example/agents/tunnel/", {})


def test_an_app_that_never_answers_is_stopped_with_its_logs_last_lines(tmp_path: Path) -> None:
    """A real run on the bare-metal backend: the app prints and sleeps, never serving its port."""
    script = "import time; print('loading weights'); print('still loading', flush=True); time.sleep(60)"
    spec = {"command": [sys.executable, "-c", script], "app": {**APP, "port": free_port()}}
    failed, result, took = failed_app(tmp_path, spec)
    assert 2 <= took < 10
    assert len(failed) == 1
    assert failed[0].startswith("the app did not answer its health check (GET / on port ")
    assert result["exit_code"] != 0
    assert "did not answer its health check" in result["reason"]
    assert result["reason"].endswith("its log ends: loading weights | still loading")


def failed_app(tmp_path: Path, spec: dict[str, Any]) -> tuple[list[str], dict[str, Any], float]:
    """A real run of `spec` on the bare-metal backend whose app is expected to fail: the reasons its tunnel
    gave, the run's result, and how long the tunnel ran."""
    metal = backend(tmp_path)
    recorder = Recorder(metal.state)
    failed: list[str] = []
    took = 0.0

    async def scenario() -> None:
        nonlocal took
        await metal.start({"task_id": "t1", "lease_id": "l", "size_units": 0, "spec": spec}, recorder)

        async def fail(reason: str) -> None:
            failed.append(reason)
            await metal.fail("t1", reason, grace_seconds=2)

        async def say(line: str) -> None:
            raise AssertionError(f"an app expected to fail was said to answer: {line}")

        app = AppSpec.parse(spec["app"])
        tunnel = AppTunnel(
            url="http://demo.localhost:1", credentials={}, task_id="t1", lease_id="l",
            app=app, locate=lambda: metal.app_upstream("t1", app), fail=fail, say=say,
        )  # fmt: skip
        started = time.monotonic()
        await asyncio.wait_for(tunnel.run(), 30)
        took = time.monotonic() - started
        await asyncio.wait_for(recorder.finished.wait(), 30)

    asyncio.run(scenario())
    (result,) = [body for kind, body in recorder.reports if kind == "result"]
    return failed, result, took


def test_an_ended_tunnel_forgets_itself_not_a_newer_runs(tmp_path: Path) -> None:
    agent = Agent(url="http://demo.localhost:1", token="t", backend=backend(tmp_path), agent_id="a")

    async def scenario() -> None:
        old, new = (asyncio.create_task(asyncio.sleep(0)) for _ in range(2))
        await asyncio.gather(old, new)
        agent.tunnels["t1"] = new  # the task's next run opened its own while the old one was ending
        agent._tunnel_ended("t1", old)
        assert agent.tunnels == {"t1": new}
        agent._tunnel_ended("t1", new)
        assert agent.tunnels == {}

    asyncio.run(scenario())


def tunnel_to(port: int) -> AppTunnel:
    """An app's tunnel for an app on `port`, driven frame by frame by the test (no plane)."""
    return AppTunnel(
        url="http://demo.localhost:1", credentials={}, task_id="t", lease_id="l",
        app=AppSpec("0123abcd", port), locate=None, fail=None, say=None,  # type: ignore[arg-type]
    )  # fmt: skip


class Sent:
    """The tunnel's socket to the plane, as a list of the frames sent on it."""

    def __init__(self) -> None:
        self.frames: list[Any] = []

    async def send(self, data: bytes) -> None:
        from protocol import tunnel

        self.frames.append(tunnel.Frame.decode(data))


@pytest.mark.parametrize(
    "head",
    [
        {"websocket": True, "resume": "nobody-knows-this", "received": 0},
        {"websocket": True, "resume": "kept", "received": 5},  # more than the app was ever sent
        {"websocket": True, "resume": "kept", "received": "0"},
        {"websocket": True, "resume": "kept", "received": True},
        {"websocket": True, "resume": ["kept"], "received": 0},
    ],
)
def test_a_websocket_is_resumed_only_by_its_id_and_a_count_that_fits(head: dict[str, Any]) -> None:
    from agents.tunnel import _Websocket
    from protocol import tunnel

    link = tunnel_to(9999)

    async def scenario() -> list[Any]:
        link.socket = Sent()
        kept = _Websocket("kept", asyncio.Queue())  # its tunnel dropped: no stream now
        kept.outbox.record(tunnel.TEXT, b"one")
        link.websockets["kept"] = kept
        link._open(tunnel.Frame(7, tunnel.OPEN, json.dumps(head).encode()))
        await asyncio.gather(*link.tasks)
        assert kept.stream is None
        return list(link.socket.frames)

    (refused,) = asyncio.run(scenario())
    assert (refused.stream, refused.kind) == (7, tunnel.RESET)
    assert refused.document() == {"reason": "the websocket cannot be resumed"}


def test_a_resumed_websocket_hears_its_count_then_what_it_missed() -> None:
    from agents.tunnel import _Websocket
    from protocol import tunnel

    link = tunnel_to(9999)

    async def scenario() -> list[Any]:
        link.socket = Sent()
        kept = _Websocket("kept", asyncio.Queue(), subprotocol="chat", received=4)
        for word in (b"one", b"two", b"three"):
            kept.outbox.record(tunnel.TEXT, word)
        link.websockets["kept"] = kept
        head = {"websocket": True, "resume": "kept", "received": 1}
        link._open(tunnel.Frame(9, tunnel.OPEN, json.dumps(head).encode()))
        await asyncio.gather(*link.tasks)
        assert kept.stream == 9
        assert link.streams[9] is kept.queue
        return list(link.socket.frames)

    head, *again = asyncio.run(scenario())
    assert head.kind == tunnel.HEAD
    assert head.document() == {"status": 101, "subprotocol": "chat", "received": 4}
    assert [(frame.stream, frame.kind, frame.payload) for frame in again] == [
        (9, tunnel.TEXT, b"two"),
        (9, tunnel.TEXT, b"three"),
    ]


def test_an_apps_close_during_a_drop_reaches_the_client_after_the_resume() -> None:
    """The app closes its websocket while the tunnel is away: its close is kept, sent again on the resume,
    and the app's end is let go once the route says it has it."""
    import websockets

    from protocol import tunnel

    async def closes_soon(connection: Any) -> None:
        await asyncio.sleep(0.3)
        await connection.close(4001, "done")

    async def scenario() -> tuple[list[Any], bool, bool]:
        async with websockets.serve(closes_soon, "127.0.0.1", 0) as server:
            port = next(iter(server.sockets)).getsockname()[1]
            link = tunnel_to(port)
            link.socket = Sent()
            head = {"websocket": True, "resume": "r1", "target": "/", "headers": []}
            link._open(tunnel.Frame(1, tunnel.OPEN, json.dumps(head).encode()))
            socket_ = link.websockets["r1"]
            while not link.socket.frames:
                await asyncio.sleep(0.01)  # its HEAD: the app took the websocket
            link.socket = None  # the tunnel drops
            link._drop_streams()
            while socket_.outbox.sent == 0:
                await asyncio.sleep(0.01)  # the app's close, kept
            await asyncio.sleep(1.5)
            kept = "r1" in link.websockets
            link.socket = Sent()  # the next tunnel; the route resumes, having received nothing
            link._open(tunnel.Frame(2, tunnel.OPEN, json.dumps({**head, "received": 0}).encode()))
            while len(link.socket.frames) < 2:
                await asyncio.sleep(0.01)
            await link.streams[2].put(tunnel.Frame(2, tunnel.END))  # the route has the close
            for _ in range(300):
                if "r1" not in link.websockets:
                    break
                await asyncio.sleep(0.01)
            return list(link.socket.frames), kept, "r1" in link.websockets

    frames, kept, still_kept = asyncio.run(scenario())
    assert kept  # not let go while the route could not have the close
    head, close = frames
    assert (head.kind, head.document()["received"]) == (tunnel.HEAD, 0)
    assert (close.stream, close.kind, close.document()) == (2, tunnel.END, {"code": 4001})
    assert not still_kept


def _listening(family: int, address: str) -> socket.socket:
    server = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if address.startswith("::ffff:") else 1)
    server.bind((address, 0))
    server.listen()
    return server


@pytest.mark.parametrize(
    ("family", "address", "exposed"),
    [
        (socket.AF_INET, "127.0.0.1", False),
        (socket.AF_INET, "127.8.9.10", False),  # all of 127/8 is the loopback
        (socket.AF_INET6, "::1", False),
        (socket.AF_INET6, "::ffff:127.0.0.1", False),
        (socket.AF_INET, "0.0.0.0", True),  # noqa: S104 -- what the check is for
        (socket.AF_INET6, "::", True),
        (socket.AF_INET6, "::ffff:0.0.0.0", True),
        (socket.AF_INET, "own", True),  # this host's address on its network
    ],
)
def test_an_app_listening_beyond_the_loopback_is_seen(family: int, address: str, exposed: bool) -> None:
    if address == "own":  # the address this host would send from (a UDP "connection" sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(("192.0.2.1", 9))
                address = probe.getsockname()[0]
            except OSError:
                pytest.skip("this host has no route beyond its loopback")
    with _listening(family, address) as server:
        port = server.getsockname()[1]
        assert bool(node.exposed(port)) is exposed, node.listeners(port)
        if exposed:
            assert f":{port}" in node.exposure(port)
            assert "must bind it to 127.0.0.1" in node.exposure(port)
            assert node.exposed(port, os.getpgrp())  # this process's own socket
            other = subprocess.Popen(["sleep", "30"], start_new_session=True)
            try:  # another process group holds nothing on that port
                assert node.exposed(port, other.pid) == []
            finally:
                other.kill()
                other.wait()
        else:
            assert node.exposure(port) == ""
    assert node.listeners(port) == []  # closed: nothing listens there


def test_an_app_that_listens_beyond_the_loopback_is_stopped_saying_so(tmp_path: Path) -> None:
    """A real run on the bare-metal backend: the app answers its health check, but on every address of
    the host, where the route's sharing does not reach; it is stopped, its reason saying why."""
    port = free_port()
    script = (
        "import http.server, sys; print('serving', flush=True); "
        f"http.server.HTTPServer(('0.0.0.0', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()"
    )
    spec = {"command": [sys.executable, "-c", script], "app": {**APP, "port": port, "startup_seconds": 20}}
    failed, result, _ = failed_app(tmp_path, spec)
    assert len(failed) == 1
    assert failed[0].startswith(f"the app listens on 0.0.0.0:{port}, where anyone who reaches this host")
    assert "must bind it to 127.0.0.1" in result["reason"]
