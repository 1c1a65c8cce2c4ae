"""What the way to an app on a compute node adds to a request: the same app reached directly and through
its relay, in the same run.

Starts the node reporter (agents/node.py, as a batch job runs it) with a small HTTP server (uvicorn, the
catalogue tests' app) as its app: the reporter picks the app's port and opens its keyed relay. Then, from
this process, as the agent's tunnel would (httpx, asynchronous, one keep-alive connection):

- baseline: GET / to the app's port directly;
- Klique:   GET / through the agent's end (agents.relay.NodeRelay: its Unix socket, the handshake with
            the run's key) and the node's relay.

Prints requests per second and p50/p99 latency of both, the latency the relay adds, a 20 MB answer's
throughput both ways, and `ratio: <relay rps> / <direct rps>`. The route through the plane comes on top of
either (bench/app_route.py measures it).
Usage: .venv/bin/python bench/app_relay.py [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents import relay as agent_end  # noqa: E402 -- after the project root is importable

APP = [
    sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "tests" / "e2e"), "app_server:app",
    "--host", "127.0.0.1", "--port", "{port}", "--no-access-log", "--lifespan", "off",
]  # fmt: skip
BIG = 20_000_000


def percentile(values: list[float], share: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * share))]


async def measure(client: httpx.AsyncClient, count: int) -> tuple[float, list[float], float]:
    """Requests per second, each request's latency (ms), and MB/s of a 20 MB answer."""
    for _ in range(100):
        (await client.get("/")).raise_for_status()
    latencies = []
    started = time.perf_counter()
    for _ in range(count):
        before = time.perf_counter()
        (await client.get("/")).raise_for_status()
        latencies.append((time.perf_counter() - before) * 1000)
    rps = count / (time.perf_counter() - started)
    before = time.perf_counter()
    answer = await client.get(f"/big?bytes={BIG}")
    assert len(answer.content) == BIG
    return rps, latencies, BIG / 1e6 / (time.perf_counter() - before)


async def both(folder: Path, key: str, count: int) -> dict[str, tuple[float, list[float], float]]:
    ports = json.loads((folder / "app-address").read_text())
    direct = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports['app']}", timeout=60)
    relay = await agent_end.NodeRelay("127.0.0.1", ports["relay"], ports["app"], key).open()
    through = httpx.AsyncClient(transport=relay.transport(), base_url=relay.local, timeout=60)
    try:
        results: dict[str, list[tuple[float, list[float], float]]] = {"direct": [], "relay": []}
        for _ in range(3):  # alternate, so that both see the same moments of a noisy machine
            results["direct"].append(await measure(direct, count // 3))
            results["relay"].append(await measure(through, count // 3))
        return {
            name: (
                sum(rps for rps, _, _ in runs) / len(runs),
                [latency for _, latencies, _ in runs for latency in latencies],
                sum(mbps for _, _, mbps in runs) / len(runs),
            )
            for name, runs in results.items()
        }
    finally:
        await direct.aclose()
        await through.aclose()
        await relay.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        key = agent_end.new_key()
        (folder / "token").write_text("kqt_bench")
        (folder / "app-key").write_text(key)
        reporter = subprocess.Popen(
            [
                sys.executable, str(ROOT / "agents" / "node.py"), "--url", "http://127.0.0.1:9",
                "--task", "bench", "--token-file", str(folder / "token"), "--workdir", str(folder),
                "--final-seconds", "0", "--metrics-seconds", "0", "--app-port", "auto",
                "--app-key-file", str(folder / "app-key"), "--", *APP,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    port = json.loads((folder / "app-address").read_text())["app"]
                    httpx.get(f"http://127.0.0.1:{port}/", timeout=2).raise_for_status()
                    break
                except (OSError, ValueError, httpx.HTTPError):
                    if time.monotonic() > deadline or reporter.poll() is not None:
                        print("the app did not start behind its relay", file=sys.stderr)
                        return 1
                    time.sleep(0.2)
            found = asyncio.run(both(folder, key, args.requests))
        finally:
            reporter.terminate()
            reporter.wait(10)
    (direct_rps, direct_ms, direct_mbps), (relay_rps, relay_ms, relay_mbps) = found["direct"], found["relay"]
    print(f"requests per way: {len(direct_ms)}, sequential, one keep-alive connection; 20 MB once a round")
    print(f"{'':>28} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'MB/s':>8}")
    for name, rps, latencies, mbps in (
        ("direct (baseline)", direct_rps, direct_ms, direct_mbps),
        ("through the relay (Klique)", relay_rps, relay_ms, relay_mbps),
    ):
        p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
        print(f"{name:>28} {rps:9.0f} {p50:8.2f} {p99:8.2f} {mbps:8.0f}")
    added = percentile(relay_ms, 0.5) - percentile(direct_ms, 0.5)
    print(f"the relay adds {added:.2f} ms at p50")
    print(f"ratio: {relay_rps / direct_rps:.3f} ({relay_rps:.0f} / {direct_rps:.0f} req/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
