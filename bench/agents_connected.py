"""A thousand agents connected at once: what each costs the plane, and whether work still reaches them fast.

Two `klique web` processes and one worker on a scratch database; `--agents` protocol clients (each its own
pool-scoped token, bound to its own agent id) spread over `--processes` client processes, half of them
connected to each web process. The clients speak the agent protocol as the real agent does: hello,
heartbeats at the interval the welcome gives (10 s by default), websocket pings at the library's default,
and for an assignment accepted, running, result. What is measured, in one run:

- assignment latency (submit to dispatch, from the task's own events) of tasks sent one at a time into free
  capacity, first with one agent per pool connected (the baseline), then with all of them;
- the web processes' CPU per connected agent, over a steady minute, and their memory per connection;
- how long after one web process is killed and started again every agent is connected again.

The last line's ratio is the assignment p99 with every agent connected over the baseline's.
Usage: .venv/bin/python bench/agents_connected.py [--agents 1000] [--processes 4] [--pools 10] [--steady 60]
Needs PostgreSQL and Redis on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from typing import Any

import httpx
import websockets
from scratch import KLIQUE, ROOT, dispatch_latency, free_port, scratch_klique

sys.path.insert(0, str(ROOT))
from protocol import messages

HZ = os.sysconf("SC_CLK_TCK")
PROBES = 30


# The clients -----------------------------------------------------------------------------------------


async def agent(slot: int, token: str, port: int, connected: Any, stop: Event) -> None:
    """One agent: connect, hello, heartbeat; run what it is given at once (accepted, running, result);
    reconnect after a short random pause when the connection drops."""
    headers = {"Authorization": f"Bearer {token}"}
    hello = messages.Hello(
        agent_id=f"bench-{slot}", backend="bench", version="bench", inventory={"gpus": 8, "mig": []}
    )
    while not stop.is_set():
        try:
            async with websockets.connect(
                "ws://demo.localhost/agents/ws/",
                host="127.0.0.1",
                port=port,
                additional_headers=headers,
                open_timeout=60,
            ) as socket_:
                await socket_.send(json.dumps(hello.as_json()))
                beats: asyncio.Task[None] | None = None
                try:
                    async for raw in socket_:
                        message = json.loads(raw)
                        if message.get("type") == "welcome":
                            connected[slot] = 1
                            beats = asyncio.create_task(
                                heartbeats(socket_, float(message["heartbeat_seconds"]))
                            )
                        elif message.get("type") == "assign":
                            task, lease = message["task_id"], message["lease_id"]
                            await socket_.send(json.dumps(messages.Accepted(task, lease).as_json()))
                            running = messages.Report("status", task, lease, 1, {"state": "running"})
                            await socket_.send(json.dumps(running.as_json()))
                            ended = messages.Report("result", task, lease, 2, {"exit_code": 0, "outputs": []})
                            await socket_.send(json.dumps(ended.as_json()))
                finally:
                    connected[slot] = 0
                    if beats is not None:
                        beats.cancel()
        except (OSError, websockets.WebSocketException, TimeoutError):
            connected[slot] = 0
        await asyncio.sleep(random.uniform(0.5, 1.5))


async def heartbeats(socket_: Any, every: float) -> None:
    await asyncio.sleep(random.uniform(0, every))  # spread, as agents started at different times are
    while True:
        await socket_.send(json.dumps(messages.Heartbeat().as_json()))
        await asyncio.sleep(every)


def clients(slots: list[tuple[int, str, int]], connected: Any, stop: Event) -> None:
    async def run() -> None:
        agents = [
            asyncio.create_task(agent(slot, token, port, connected, stop)) for slot, token, port in slots
        ]
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for each in agents:
            each.cancel()
        await asyncio.gather(*agents, return_exceptions=True)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(run())


# The plane -------------------------------------------------------------------------------------------


def provision(client: httpx.Client, pools: int, agents: int) -> list[str]:
    """`pools` pools of 64 GPUs (bench-0 first in the one profile's order), compute resource "Bench";
    `agents` tokens, spread over the pools; returns them in slot order (slot i on pool i % pools)."""
    document = client.get("/api/v1/configuration/draft/").json()["document"]
    names = [f"bench-{index}" for index in range(pools)]
    for name in names:
        document["pools"].append({"name": name, "environment": "baremetal", "capacity_gpus": 64})
    document["profiles"].append({"name": "bench", "gpus": "1", "pools": [{"pool": name} for name in names]})
    document["policies"][0]["limit_gpus"] = str(100_000)
    document["policies"][0]["compute_resources"].append({"profile": "bench", "name": "Bench"})
    client.put("/api/v1/configuration/draft/", json={"document": document}).raise_for_status()
    client.post("/api/v1/configuration/draft/provision/").raise_for_status()
    ids = {
        pool["name"]: pool["id"]
        for pool in client.get("/api/v1/pools/", params={"limit": 500}).json()["results"]
    }
    tokens = []
    for slot in range(agents):
        created = client.post(
            f"/api/v1/pools/{ids[names[slot % pools]]}/agent-tokens/", json={"name": f"a{slot}"}
        )
        created.raise_for_status()
        tokens.append(created.json()["token"])
    return tokens


def latency(client: httpx.Client, database_url: str, prefix: str) -> tuple[float, float, list[str]]:
    """Submit-to-dispatch p50 and p99 in seconds of PROBES tasks sent one at a time, each waited for up to
    a minute; and the state and reason of those that did not complete in that time."""
    late = []
    for index in range(PROBES):
        task = client.post(
            "/api/v1/tasks/",
            json={"compute_resource": "Bench", "name": f"{prefix}-{index}", "spec": {"command": ["true"]}},
        ).json()
        deadline = time.monotonic() + 60
        while (seen := client.get(f"/api/v1/tasks/{task['id']}/").json())["state"] != "completed":
            if time.monotonic() > deadline:
                late.append(f"{seen['state']}: {seen.get('reason') or ''}")
                break
            time.sleep(0.05)
    return (*dispatch_latency(database_url, f"{prefix}-%"), late)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def web_process(environment: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    """`klique web` on `port` (one uvicorn process, which it execs into: its pid is the server's)."""
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": ROOT}
    web = subprocess.Popen([*KLIQUE, "web", "--port", str(port)], env=environment, **quiet)
    for _ in range(300):
        with contextlib.suppress(httpx.HTTPError):
            if (
                httpx.get(f"http://127.0.0.1:{port}/readyz", headers={"Host": "demo.localhost"}).status_code
                == 200
            ):
                return web
        time.sleep(0.1)
    raise RuntimeError(f"klique web on {port} did not become ready")


def wait_connected(connected: Any, count: int, timeout: float) -> float:
    """Seconds until at least `count` agents are connected (welcomed)."""
    started = time.monotonic()
    while sum(connected) < count:
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"only {sum(connected)} of {count} agents connected after {timeout:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - started


@contextlib.contextmanager
def running(children: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for child in reversed(children):
            with contextlib.suppress(Exception):
                child.terminate()
        for child in reversed(children):
            with contextlib.suppress(Exception):
                child.wait(timeout=30) if isinstance(child, subprocess.Popen) else child.join(timeout=30)


def main() -> int:  # noqa: PLR0915 (one measured story, told in order)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument(
        "--processes", type=int, default=4, help="client processes the agents are spread over"
    )
    parser.add_argument("--pools", type=int, default=10)
    parser.add_argument("--steady", type=float, default=60.0, help="seconds of the steady window")
    args = parser.parse_args()
    context = multiprocessing.get_context("fork")
    with scratch_klique(redis_db=11, KLIQUE_CYCLE_DEBOUNCE_MS="100") as (environment, demo):  # as drain.py
        ports = [free_port(), free_port()]
        headers = {"Host": "demo.localhost", "Authorization": f"Bearer {demo['admin_token']}"}
        webs = [web_process(environment, port) for port in ports]
        quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": ROOT}
        worker = subprocess.Popen([*KLIQUE, "worker", "--concurrency", "1"], env=environment, **quiet)
        children: list[Any] = [worker, *webs]
        with running(children):
            client = httpx.Client(base_url=f"http://127.0.0.1:{ports[0]}", headers=headers, timeout=120)
            tokens = provision(client, args.pools, args.agents)
            connected = context.Array("b", args.agents, lock=False)
            stop = context.Event()
            slots = [(slot, token, ports[slot % 2]) for slot, token in enumerate(tokens)]

            def start(chosen: list[tuple[int, str, int]]) -> None:
                for index in range(args.processes):
                    process = context.Process(
                        target=clients, args=(chosen[index :: args.processes], connected, stop)
                    )
                    process.start()
                    children.append(process)

            # The baseline: one agent per pool.
            start(slots[: args.pools])
            wait_connected(connected, args.pools, 120)
            idle_p50, idle_p99, idle_late = latency(client, environment["DATABASE_URL"], "few")
            idle_rss = sum(rss_bytes(web.pid) for web in webs)

            # Every agent.
            start(slots[args.pools :])
            connect_seconds = wait_connected(connected, args.agents, 600)
            time.sleep(min(10.0, args.steady / 4))  # let the first heartbeats spread out
            before = sum(cpu_seconds(web.pid) for web in webs)
            time.sleep(args.steady)
            web_cpu = sum(cpu_seconds(web.pid) for web in webs) - before
            all_rss = sum(rss_bytes(web.pid) for web in webs)
            busy_p50, busy_p99, busy_late = latency(client, environment["DATABASE_URL"], "all")

            # One web process killed and started again on its address.
            webs[1].kill()
            webs[1].wait()
            gone = time.monotonic()
            webs[1] = web_process(environment, ports[1])
            children.append(webs[1])
            restarted = time.monotonic() - gone
            back = wait_connected(connected, args.agents, 600) + restarted
            stop.set()

    per_agent_ms = web_cpu / args.steady / args.agents * 1000
    memory_kib = (all_rss - idle_rss) / max(1, args.agents - args.pools) / 1024
    print(f"{args.agents} agents ({args.processes} client processes) on 2 web processes, {args.pools} pools")
    print(f"connecting all: {connect_seconds:.1f} s")
    print(
        f"web CPU over a steady {args.steady:.0f} s: {web_cpu:.1f} s, "
        f"{per_agent_ms:.3f} ms per second per connected agent "
        f"({per_agent_ms * 10:.1f} cores for 10,000 agents)"
    )
    print(f"web memory per connection: {memory_kib:.0f} KiB")
    print(f"{'assignment latency':28}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{f'{args.pools} agents connected':28}{idle_p50 * 1000:>10.0f}{idle_p99 * 1000:>10.0f}")
    print(f"{f'{args.agents} agents connected':28}{busy_p50 * 1000:>10.0f}{busy_p99 * 1000:>10.0f}")
    for label, late in ((f"{args.pools} agents", idle_late), (f"{args.agents} agents", busy_late)):
        if late:
            print(f"{len(late)} of {PROBES} probes with {label} not completed within a minute: {late[:3]}")
    print(
        f"one web process killed and restarted: every agent back in {back:.1f} s "
        f"(its start: {restarted:.1f} s)"
    )
    ratio = busy_p99 / idle_p99
    print(
        f"ratio: {ratio:.2f} ({busy_p99 * 1000:.0f} ms / {idle_p99 * 1000:.0f} ms, assignment p99 with "
        f"{args.agents} agents / with {args.pools})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
