"""An app's relay on its compute node (agents.node.AppRelay) and the agent's end of it (agents.relay):
the node reporter started as a real process with an app behind it; the relay leads to the app only for a
caller who opens with the run's key, and the agent sends nothing on to a far end that is not the relay."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agents import node
from agents import relay as agent_end
from agents.hpc import apps

APP = """
import http.server, os, sys
count = 0
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        body = f"port={os.environ['PORT']} {sys.argv[1]} path={self.path} requests={count}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
"""


class Running:
    def __init__(self, process: subprocess.Popen[bytes], folder: Path, key: str) -> None:
        self.process, self.folder, self.key = process, folder, key

    @property
    def relay(self) -> int:
        return int(json.loads((self.folder / "app-address").read_text())["relay"])

    @property
    def app(self) -> int:
        return int(json.loads((self.folder / "app-address").read_text())["app"])

    def get(self, path: str = "/") -> str:
        async def fetch() -> str:
            upstream = await agent_end.NodeRelay("127.0.0.1", self.relay, self.app, self.key).open()
            try:
                async with httpx.AsyncClient(
                    transport=upstream.transport(), base_url=upstream.local
                ) as client:
                    answer = await client.get(path)
                    answer.raise_for_status()
                    return answer.text
            finally:
                await upstream.aclose()

        return asyncio.run(fetch())


@pytest.fixture
def relayed(tmp_path: Path) -> Iterator[Running]:
    """The node reporter running an app (a port picked on this host), reporting to a plane that is not
    there (nothing here needs one)."""
    running = start_reporter(tmp_path, [sys.executable, "-c", APP, "--port={port}"])
    yield running
    running.process.terminate()
    running.process.wait(10)


def start_reporter(folder: Path, command: list[str]) -> Running:
    """The node reporter (a process of its own) running an app, once it answers through its relay."""
    key = agent_end.new_key()
    (folder / "token").write_text("kqt_x")
    (folder / "app-key").write_text(key)
    argv = [
        sys.executable, node.__file__, "--url", "http://127.0.0.1:9", "--task", "t1",
        "--token-file", str(folder / "token"), "--workdir", str(folder), "--final-seconds", "0",
        "--metrics-seconds", "0", "--app-port", "auto", "--app-key-file", str(folder / "app-key"),
        "--", *command,
    ]  # fmt: skip
    running = Running(subprocess.Popen(argv), folder, key)
    deadline = time.monotonic() + 30
    while True:
        try:
            running.get("/ready")
            return running
        except (OSError, ValueError, httpx.HTTPError):
            if running.process.poll() is not None or time.monotonic() > deadline:
                running.process.kill()
                raise AssertionError("the app never answered through its relay") from None
            time.sleep(0.1)


def test_the_node_picks_the_apps_port_and_the_relay_leads_to_it_with_the_key(relayed: Running) -> None:
    answer = relayed.get("/notebooks?x=1")
    port, argument, path, _ = answer.split()
    assert port == f"port={relayed.app}"  # PORT is the port picked,
    assert argument == f"--port={relayed.app}"  # and {port} of the command is too
    assert path == "path=/notebooks?x=1"
    assert relayed.relay != relayed.app
    written = json.loads((relayed.folder / "app-address").read_text())
    assert written == {"relay": relayed.relay, "app": relayed.app}
    assert apps.ports(json.dumps(written)) == (relayed.relay, relayed.app)


def raw_exchange(port: int, payload: bytes, pause: float = 0.0) -> bytes:
    """What the relay answers to `payload` (sent in two halves, `pause` apart, and then no more) before
    it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as connection:
        half = len(payload) // 2
        connection.sendall(payload[:half])
        time.sleep(pause)
        connection.sendall(payload[half:])
        connection.shutdown(socket.SHUT_WR)
        received = b""
        with contextlib.suppress(ConnectionResetError):  # closed with what was sent unread: reset
            while chunk := connection.recv(4096):
                received += chunk
        return received


def wrong_hellos(key: str) -> list[bytes]:
    other = agent_end.new_key()
    return [
        b"",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # plain HTTP, as a port scan or a browser would send
        agent_end.hello(other),  # another run's key
        agent_end.hello(key.upper()),  # the key, other case
        agent_end.HELLO + key[:-1].encode() + b"\n",  # one digit short
        agent_end.HELLO + key.encode() + b" \n",  # one byte more
        b"KLIQUE-APP/2 " + key.encode() + b"\n",  # another version's words
        agent_end.hello(key)[:-1] + b"\r",
        b"\x00" * len(agent_end.hello(key)),
    ]


def test_anyone_without_the_runs_key_reaches_nothing(relayed: Running) -> None:
    for payload in wrong_hellos(relayed.key):
        assert raw_exchange(relayed.relay, payload) == b"", payload
    # Not one of them reached the app: the next request through the relay is its second.
    assert relayed.get("/").endswith("requests=2")


def test_the_key_may_come_in_pieces_and_the_app_answers_behind_the_relays_words(relayed: Running) -> None:
    request = b"GET /split HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    answered = raw_exchange(relayed.relay, agent_end.hello(relayed.key) + request, pause=0.3)
    assert answered.startswith(agent_end.ANSWER + b"HTTP/1.")
    assert answered.endswith(b"path=/split requests=2")


def test_a_caller_who_sends_nothing_is_let_go(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The relay in this process, with a short handshake time: a silent caller holds no thread for long."""
    monkeypatch.setattr(node, "APP_HANDSHAKE_SECONDS", 0.5)
    relay = node.AppRelay(agent_end.new_key(), 9)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as silent:
            started = time.monotonic()
            assert silent.recv(10) == b""
            assert time.monotonic() - started < 4
    finally:
        relay.server.close()


def test_callers_who_say_nothing_cannot_crowd_out_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """More silent callers than the relay waits on at once are turned away at once; each one waited on
    frees its place when its time is up (or it is refused), and the agent gets through after."""
    monkeypatch.setattr(node, "APP_HANDSHAKES", 4)
    monkeypatch.setattr(node, "APP_HANDSHAKE_SECONDS", 1.0)
    app = socket.create_server(("127.0.0.1", 0))
    key = agent_end.new_key()
    relay = node.AppRelay(key, app.getsockname()[1])
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    try:
        silent = [socket.create_connection(("127.0.0.1", relay.port), timeout=5) for _ in range(4)]
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as turned_away:
            started = time.monotonic()
            assert turned_away.recv(10) == b""
            assert time.monotonic() - started < 0.5  # not waited on at all
        for caller in silent:
            assert caller.recv(10) == b""  # let go after their time
            caller.close()
        with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as agent:
            agent.sendall(agent_end.hello(key))
            assert agent.recv(len(agent_end.ANSWER)) == agent_end.ANSWER
    finally:
        relay.server.close()
        app.close()


@pytest.mark.parametrize("key", ["", "abc", "Z" * 64, "0" * 63, "0" * 65])
def test_a_relay_needs_a_key_of_64_hex_digits(key: str) -> None:
    with pytest.raises(ValueError, match="does not hold a key"):
        node.AppRelay(key, 9)


def test_the_node_and_the_agent_speak_the_same_words() -> None:
    assert (node.APP_HELLO, node.APP_ANSWER) == (agent_end.HELLO, agent_end.ANSWER)
    assert node.APP_ADDRESS_FILE == apps.ADDRESS_FILE


class Listener:
    """A service that is not a relay: records what it gets and answers `answer` (then closes)."""

    def __init__(self, answer: bytes | None) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received = b""
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        connection, _ = self.server.accept()
        with connection:
            connection.settimeout(3)
            try:
                while chunk := connection.recv(4096):
                    self.received += chunk
                    if self.answer is not None:
                        connection.sendall(self.answer)
                        return
            except OSError:
                return


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",  # an HTTP service of the node
        b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n",  # one that speaks first, with more than the answer's length
        b"KLIQUE-APP/1 NO\n",  # the relay's words, not its answer
        b"",  # one that closes at once
        None,  # one that says nothing
    ],
)
def test_the_agent_sends_nothing_on_to_a_far_end_that_is_not_the_relay(
    monkeypatch: pytest.MonkeyPatch, answer: bytes | None
) -> None:
    """A port the job's folder names is the account's word: whatever listens there gets the hello line
    and no request."""
    monkeypatch.setattr(agent_end, "HANDSHAKE_SECONDS", 1.0)
    service = Listener(answer)
    key = agent_end.new_key()

    async def scenario() -> str:
        upstream = await agent_end.NodeRelay("127.0.0.1", service.port, 8888, key).open()
        try:
            async with httpx.AsyncClient(transport=upstream.transport(), base_url=upstream.local) as client:
                with pytest.raises(httpx.HTTPError):
                    await client.post("/api/secret", content=b"a request body")
            return upstream.describe()
        finally:
            await upstream.aclose()

    described = asyncio.run(scenario())
    assert service.received == agent_end.hello(key)
    assert "(" in described
    assert described.startswith("port 8888 of node 127.0.0.1")


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[40000, 40001]",
        '{"relay": 40000}',
        '{"relay": 40000, "app": 40001, "host": "10.0.0.1"}',
        '{"relay": "40000", "app": 40001}',
        '{"relay": 40000, "app": true}',
        '{"relay": 22, "app": 40001}',
        '{"relay": 40000, "app": 70000}',
        '{"relay": 40000.0, "app": 40001}',
    ],
)
def test_an_address_the_job_wrote_wrong_is_refused_saying_why(text: str) -> None:
    with pytest.raises(apps.AddressInvalid):
        apps.ports(text)


def test_no_address_yet_is_not_an_error() -> None:
    assert apps.ports(None) is None
    assert apps.ports("") is None
    assert apps.ports('{"relay": 40000, "app": 40001}') == (40000, 40001)


def test_the_agents_socket_to_the_app_is_its_own(tmp_path: Path) -> None:
    async def scenario() -> None:
        upstream = await agent_end.NodeRelay("127.0.0.1", 40000, 40001, agent_end.new_key()).open()
        folder = Path(upstream.path).parent
        assert folder.stat().st_mode & 0o777 == 0o700
        await upstream.aclose()
        assert not folder.exists()

    asyncio.run(scenario())


def test_a_websocket_reaches_the_app_through_the_relay(tmp_path: Path) -> None:
    """The catalogue tests' app (uvicorn, with a websocket echo) behind a node reporter's relay: the
    tunnel's websockets to an app on a compute node go the same way as its requests."""
    e2e = Path(__file__).resolve().parents[1] / "e2e"
    running = start_reporter(
        tmp_path,
        [
            sys.executable, "-m", "uvicorn", "--app-dir", str(e2e), "app_server:app", "--host", "127.0.0.1",
            "--port", "{port}", "--no-access-log", "--lifespan", "off",
        ],
    )  # fmt: skip

    async def echo() -> list[str]:
        upstream = await agent_end.NodeRelay("127.0.0.1", running.relay, running.app, running.key).open()
        try:
            async with upstream.websocket(f"ws://127.0.0.1:{running.app}/ws", open_timeout=10) as socket_:
                answers = []
                for word in ("one", "two"):
                    await socket_.send(word)
                    answers.append(str(await socket_.recv()))
                return answers
        finally:
            await upstream.aclose()

    try:
        assert asyncio.run(echo()) == ["echo: one", "echo: two"]
    finally:
        running.process.terminate()
        running.process.wait(10)


def relay_alone(port: int, app_port: int, key: str | None) -> subprocess.Popen[str]:
    """`klique-node relay` as a pod's sidecar runs it, with the key in its environment."""
    environment = {"PATH": "/usr/bin:/bin"} | ({node.APP_KEY_VARIABLE: key} if key is not None else {})
    return subprocess.Popen(
        [sys.executable, "-m", "agents.node", "relay", "--port", str(port), "--app-port", str(app_port)],
        env=environment,
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_the_relay_alone_leads_to_an_app_beside_it_only_with_the_key_and_stops_on_sigterm() -> None:
    app_port, port, key = node.free_loopback_port(), node.free_loopback_port(), agent_end.new_key()
    app = subprocess.Popen(
        [sys.executable, "-c", APP, "beside"], env={"PORT": str(app_port), "PATH": "/usr/bin:/bin"}
    )
    relay = relay_alone(port, app_port, key)
    try:
        assert relay.stdout is not None
        assert relay.stdout.readline().strip() == (
            f"klique-node relay: port {port} leads to the app on port {app_port}"
        )
        deadline = time.monotonic() + 20
        while True:
            answered = raw_exchange(port, agent_end.hello(key) + b"GET /x HTTP/1.0\r\n\r\n", pause=0.1)
            if answered.startswith(agent_end.ANSWER + b"HTTP/1.0 200"):
                break
            assert time.monotonic() < deadline, answered
            time.sleep(0.2)
        assert answered.endswith(f"port={app_port} beside path=/x requests=1".encode())
        for stranger in (agent_end.hello(agent_end.new_key()), b"GET / HTTP/1.0\r\n\r\n" + b"." * 80):
            assert raw_exchange(port, stranger) == b"", stranger
        relay.terminate()
        assert relay.wait(10) == 0
    finally:
        for process in (app, relay):
            process.kill()
            process.wait(10)


@pytest.mark.parametrize("key", [None, "", "0" * 63, "A" * 64, "0" * 32 + " " + "0" * 31, "0" * 64 + "0"])
def test_the_relay_alone_will_not_start_without_a_key(key: str | None) -> None:
    relay = relay_alone(node.free_loopback_port(), node.free_loopback_port(), key)
    output, _ = relay.communicate(timeout=20)
    assert relay.returncode == 2
    assert "$KLIQUE_APP_KEY does not hold the run's app key (64 hexadecimal digits)" in output


def test_the_relay_alone_says_when_its_port_is_taken() -> None:
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        relay = relay_alone(port, node.free_loopback_port(), agent_end.new_key())
        output, _ = relay.communicate(timeout=20)
    assert relay.returncode == 1
    assert f"klique-node relay: port {port} cannot be opened" in output


def test_the_node_stops_an_app_that_listens_beyond_its_loopback_saying_why(tmp_path: Path) -> None:
    """The relay is an app's only way in: one that listens on every address of the node is stopped once
    it listens, and the job's output (which the agent quotes) says why."""
    exposed = APP.replace('HTTPServer(("127.0.0.1",', 'HTTPServer(("0.0.0.0",')
    assert exposed != APP
    (tmp_path / "token").write_text("kqt_x")
    (tmp_path / "app-key").write_text(agent_end.new_key())
    argv = [
        sys.executable, node.__file__, "--url", "http://127.0.0.1:9", "--task", "t1",
        "--token-file", str(tmp_path / "token"), "--workdir", str(tmp_path), "--final-seconds", "0",
        "--metrics-seconds", "0", "--app-port", "auto", "--app-key-file", str(tmp_path / "app-key"),
        "--", sys.executable, "-c", exposed, "open",
    ]  # fmt: skip
    reporter = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    port = json.loads((tmp_path / "app-address").read_text())["app"]
    assert f"klique: the app listens on 0.0.0.0:{port}, where anyone who reaches this host's network" in (
        reporter.stdout
    ), reporter.stdout + reporter.stderr
    assert reporter.returncode != 0  # ended by the reporter's SIGTERM
    assert node.listeners(port) == []
