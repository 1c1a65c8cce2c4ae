"""What the internal route adds to a request to an app: the same local HTTP server reached directly and
through its route, in the same run.

Starts a real Klique (`klique web` and a worker, on a fresh database with the demo tenant), a bare-metal
agent, and an app from a catalogue entry: a small HTTP server (uvicorn) that answers GET / with a short
text. Then sends sequential keep-alive requests:

- baseline: GET / to the app's port on this host, directly;
- Klique:   GET / to the app's own host (app-<slug>.demo.localhost), through the plane's route, the
            channel layer and the agent's tunnel, with a bearer token checked on every request.

Prints requests per second and p50/p99 latency of both, the latency the route adds, and
`ratio: <route rps> / <direct rps>`.
Usage: .venv/bin/python bench/app_route.py [--requests 2000]
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from scratch import KLIQUE, ROOT, free_port, scratch_klique

APP = [
    sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "tests" / "e2e"), "app_server:app",
    "--host", "127.0.0.1", "--port", "{port}", "--no-access-log", "--lifespan", "off",
]  # fmt: skip


def measure(
    client: httpx.Client, url: str, headers: dict[str, str], count: int, body: dict[str, Any] | None = None
) -> tuple[float, list[float]]:
    """Requests per second and each request's latency (ms): GET, or POST of `body` as JSON."""
    method = "POST" if body is not None else "GET"
    for _ in range(50):  # warm up the connection, the channel layer's subscriptions, the caches
        client.request(method, url, headers=headers, json=body).raise_for_status()
    latencies = []
    started = time.perf_counter()
    for _ in range(count):
        before = time.perf_counter()
        client.request(method, url, headers=headers, json=body).raise_for_status()
        latencies.append((time.perf_counter() - before) * 1000)
    return count / (time.perf_counter() - started), latencies


def percentile(values: list[float], share: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * share))]


def pool_token(client: httpx.Client) -> str:
    document = client.get("/api/v1/configuration/draft/").json()["document"]
    document["pools"].append({"name": "apps", "environment": "baremetal", "capacity_gpus": 1})
    document["profiles"].append({"name": "app", "gpus": "1", "pools": [{"pool": "apps"}]})
    document["policies"][0]["compute_resources"].append({"profile": "app", "name": "Apps"})
    client.put("/api/v1/configuration/draft/", json={"document": document}).raise_for_status()
    client.post("/api/v1/configuration/draft/provision/").raise_for_status()
    pool = next(p for p in client.get("/api/v1/pools/").json()["results"] if p["name"] == "apps")
    answer = client.post(f"/api/v1/pools/{pool['id']}/agent-tokens/", json={"name": "apps"})
    return str(answer.json()["token"])


@contextlib.contextmanager
def app_running(
    entry: dict[str, Any], launch: dict[str, Any]
) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """A real Klique (web and worker) with a bare-metal agent, and an app of `entry` launched and ready:
    (the plane's port, the demo's tokens, the app as the API shows it with its port in `port`)."""
    port = free_port()
    with scratch_klique(redis_db=12) as (environment, demo), tempfile.TemporaryDirectory() as folder:
        quiet = {"env": environment, "cwd": ROOT, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        children: list[subprocess.Popen[bytes]] = []
        try:
            children.append(subprocess.Popen([*KLIQUE, "web", "--port", str(port)], **quiet))  # type: ignore[call-overload]
            children.append(subprocess.Popen([*KLIQUE, "worker", "--concurrency", "1"], **quiet))  # type: ignore[call-overload]
            tenant = {"Host": f"demo.localhost:{port}", "Authorization": f"Bearer {demo['admin_token']}"}
            plane = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=tenant, timeout=60)
            for _ in range(300):
                try:
                    if plane.get("/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            token_file = Path(folder) / "agent.token"
            token_file.write_text(pool_token(plane))
            token_file.chmod(0o600)
            agent = [
                sys.executable, "-m", "agents.main", "--url", f"http://demo.localhost:{port}",
                "--token-file", str(token_file), "--gpus", "1", "--agent-id", "apps",
                "--work-dir", str(Path(folder) / "agent"),
            ]  # fmt: skip
            children.append(subprocess.Popen(agent, **quiet))  # type: ignore[call-overload]
            plane.post("/api/v1/catalogue/", json=entry).raise_for_status()
            app = plane.post("/api/v1/apps/", json={"entry": entry["name"], **launch}).json()
            deadline = time.monotonic() + 120
            while (app := plane.get(f"/api/v1/apps/{app['id']}/").json())["state"] != "ready":
                if time.monotonic() > deadline:
                    raise SystemExit(f"the app never became ready: {app}")
                time.sleep(0.2)
            logged = " ".join(line for chunk in plane.get(f"/api/v1/tasks/{app['task_id']}/logs/").json()
                              for line in chunk["lines"])  # fmt: skip
            app["port"] = int(re.search(r"the app answers on port (\d+)", logged)[1])  # type: ignore[index]
            yield port, demo, app
        finally:
            for child in reversed(children):
                child.terminate()
                child.wait(timeout=30)


def report(rows: list[tuple[str, float, list[float]]], what: str) -> None:
    print(f"{'':44}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for name, rps, latencies in rows:
        print(f"{name:44}{rps:>9.0f}{percentile(latencies, 0.5):>9.2f}{percentile(latencies, 0.99):>9.2f}")
    (_, base_rps, base), (_, rps, latencies) = rows[0], rows[-1]
    added = [percentile(latencies, share) - percentile(base, share) for share in (0.5, 0.99)]
    print(f"{what} adds {added[0]:.2f} ms at p50 and {added[1]:.2f} ms at p99")
    print(f"ratio: {rps / base_rps:.3f} ({rps:.0f} / {base_rps:.0f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    entry = {"name": "hello", "version": "1", "command": APP, "gpus": "1", "compute_resource": "Apps"}
    with app_running(entry, {}) as (port, demo, app), httpx.Client(timeout=30) as client:
        direct_rps, direct = measure(client, f"http://127.0.0.1:{app['port']}/", {}, args.requests)
        host = app["url"].split("//", 1)[1].rstrip("/")
        routed = {"Host": host, "Authorization": f"Bearer {demo['admin_token']}"}
        route_rps, through = measure(client, f"http://127.0.0.1:{port}/", routed, args.requests)
    print(f"requests: {args.requests} each, sequential, one keep-alive connection, one web process")
    report(
        [
            ("baseline  GET / to the app directly", direct_rps, direct),
            ("Klique    GET / through its route", route_rps, through),
        ],
        "the route",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
