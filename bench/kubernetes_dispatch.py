"""1,000 one-GPU tasks through the Kubernetes backend and the same work through the bare-metal backend, in
the same run: tasks per second from submit to Job created, pod succeeded to task completed (p50, p99),
and submit to completed for both.

Klique: a fresh database, `klique web`, `klique worker`, and two agents: `klique-agent --backend
kubernetes` against kmock's API emulator with a one-node cluster of 8 GPUs beside it (tests/e2e/kubelet.py:
each pod's command runs as a process here), and a bare-metal agent with 8 GPUs. Each task runs `true`.
Usage: .venv/bin/python bench/kubernetes_dispatch.py [--tasks 1000]
Needs PostgreSQL and Redis on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
from scratch import KLIQUE, ROOT, free_port, scratch_klique

sys.path.insert(0, str(ROOT))

from tests.agents.kube import Cluster  # the emulator and the one-node cluster live with the tests
from tests.e2e.kubelet import LocalNode

GPUS = 8


class TimedNode(LocalNode):
    """The one-node cluster, noting when each Job appeared and when each task's pod succeeded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.job_seen_at: dict[str, float] = {}
        self.pod_done_at: dict[str, float] = {}
        self.lock = threading.Lock()

    def _make_pods(self, job: dict[str, Any]) -> None:
        with self.lock:
            self.job_seen_at[job["metadata"]["labels"]["klique.io/task"]] = time.time()
        super()._make_pods(job)

    def _ended(self, name: str, run: Any, code: int) -> None:
        super()._ended(name, run, code)
        task = name.split("-")[1:6]
        with self.lock:
            self.pod_done_at["-".join(task)] = time.time()


def provision(client: httpx.Client) -> tuple[str, str]:
    """Pools "k8s" (Kubernetes) and "metal" (bare metal), 8 GPUs each, behind compute resources "Dispatch:
    k8s" and "Dispatch: metal"; an agent token for each."""
    document = client.get("/api/v1/configuration/draft/").json()["document"]
    for pool, environment in (("k8s", "kubernetes"), ("metal", "baremetal")):
        document["pools"].append({"name": pool, "environment": environment, "capacity_gpus": GPUS})
        document["profiles"].append({"name": f"one-{pool}", "gpus": "1", "pools": [{"pool": pool}]})
        resource = {"profile": f"one-{pool}", "name": f"Dispatch: {pool}"}
        document["policies"][0]["compute_resources"].append(resource)
    document["policies"][0]["limit_gpus"] = str(10_000)
    client.put("/api/v1/configuration/draft/", json={"document": document}).raise_for_status()
    client.post("/api/v1/configuration/draft/provision/").raise_for_status()
    tokens = []
    for name in ("k8s", "metal"):
        pool = next(p for p in client.get("/api/v1/pools/").json()["results"] if p["name"] == name)
        made = client.post(f"/api/v1/pools/{pool['id']}/agent-tokens/", json={"name": name})
        tokens.append(made.json()["token"])
    return tokens[0], tokens[1]


def completed(client: httpx.Client, resource: str) -> int:
    query: dict[str, str | int] = {"state": "completed", "compute_resource": resource, "limit": 1}
    return int(client.get("/api/v1/tasks/", params=query).json()["count"])


def drain(client: httpx.Client, resource: str, count: int) -> tuple[float, float]:
    """Submit `count` tasks at once; (when submitted, seconds until every one completed)."""
    started = time.time()
    for first in range(0, count, 1000):
        batch = [{"compute_resource": resource, "spec": {"command": ["true"]}}] * min(1000, count - first)
        client.post("/api/v1/tasks/", json=batch).raise_for_status()
    deadline = time.monotonic() + 3600
    while completed(client, resource) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return started, time.time() - started


def ended_at(database_url: str, resource: str) -> dict[str, float]:
    with psycopg.connect(database_url) as connection:
        rows = connection.execute(
            """SELECT t.id::text, extract(epoch FROM t.ended_at) FROM demo.scheduling_task t
                 JOIN demo.resources_computeresource c ON c.id = t.compute_resource_id
                WHERE c.name = %s AND t.state = 'completed'""",
            (resource,),
        ).fetchall()
    return {task: float(at) for task, at in rows}


def write_token(folder: Path, name: str, token: str) -> Path:
    path = folder / f"{name}.token"
    path.write_text(token)
    path.chmod(0o600)
    return path


def run(count: int, work: Path) -> dict[str, Any]:
    cluster = Cluster().start()
    node = TimedNode(cluster, work / "volume", gpus={"nvidia.com/gpu": GPUS})
    node.start()
    with scratch_klique(redis_db=13, KLIQUE_CYCLE_DEBOUNCE_MS="100") as (environment, demo):
        port = free_port()
        headers = {"Host": f"demo.localhost:{port}", "Authorization": f"Bearer {demo['admin_token']}"}
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": ROOT, "env": environment}
        children: list[subprocess.Popen[bytes]] = []
        try:
            children.append(subprocess.Popen([*KLIQUE, "web", "--port", str(port)], **quiet))  # type: ignore[call-overload]
            children.append(subprocess.Popen([*KLIQUE, "worker", "--concurrency", "1"], **quiet))  # type: ignore[call-overload]
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=120)
            for _ in range(300):
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            k8s_token, metal_token = provision(client)
            config = work / "agent.toml"
            config.write_text(
                f'[agent.kubernetes]\nnamespace = "ml"\napi_url = "{cluster.url}"\npoll_seconds = 0.5\n'
            )
            url = f"http://demo.localhost:{port}"
            agents = [
                [
                    "--token-file",
                    str(write_token(work, "k8s", k8s_token)),
                    "--backend",
                    "kubernetes",
                    "--config",
                    str(config),
                    "--agent-id",
                    "k8s-1",
                    "--work-dir",
                    str(work / "k8s-agent"),
                ],
                [
                    "--token-file",
                    str(write_token(work, "metal", metal_token)),
                    "--gpus",
                    str(GPUS),
                    "--agent-id",
                    "metal-1",
                    "--work-dir",
                    str(work / "metal-agent"),
                ],
            ]
            for argv in agents:
                command = [sys.executable, "-m", "agents.main", "--url", url, *argv]
                children.append(subprocess.Popen(command, **quiet))  # type: ignore[call-overload]
            for _ in range(300):
                online = {p["name"] for p in client.get("/api/v1/pools/").json()["results"] if p["online"]}
                if {"k8s", "metal"} <= online:
                    break
                time.sleep(0.1)
            k8s_started, k8s_seconds = drain(client, "Dispatch: k8s", count)
            metal_started, metal_seconds = drain(client, "Dispatch: metal", count)
            ends = ended_at(environment["DATABASE_URL"], "Dispatch: k8s")
        finally:
            node.stop()
            for child in reversed(children):
                child.terminate()
                child.wait(timeout=30)
            cluster.stop()
    created = sorted(node.job_seen_at.values())
    lags = [ends[task] - done for task, done in node.pod_done_at.items() if task in ends]
    return {
        "k8s_seconds": k8s_seconds,
        "metal_seconds": metal_seconds,
        "created_rate": len(created) / (created[-1] - k8s_started) if created else 0.0,
        "lag_p50": statistics.median(lags) if lags else float("nan"),
        "lag_p99": statistics.quantiles(lags, n=100)[98] if len(lags) >= 2 else float("nan"),
        "metal_started": metal_started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="klique-k8s-", ignore_cleanup_errors=True) as folder:
        found = run(args.tasks, Path(folder))
    k8s_rate, metal_rate = args.tasks / found["k8s_seconds"], args.tasks / found["metal_seconds"]
    print(f"{args.tasks} one-GPU tasks (`true`), {GPUS} GPUs per pool")
    print(f"{'':40}{'seconds':>10}{'tasks/s':>10}")
    print(f"{'Kubernetes backend, submit to completed':40}{found['k8s_seconds']:>10.1f}{k8s_rate:>10.1f}")
    print(f"{'bare-metal backend, submit to completed':40}{found['metal_seconds']:>10.1f}{metal_rate:>10.1f}")
    print(f"Kubernetes, submit to Job created: {found['created_rate']:.1f} Jobs/s")
    print(
        f"Kubernetes, pod succeeded to task completed: p50 {found['lag_p50'] * 1000:.0f} ms, "
        f"p99 {found['lag_p99'] * 1000:.0f} ms"
    )
    rates = f"{k8s_rate:.1f} / {metal_rate:.1f} tasks/s"
    print(f"ratio: {k8s_rate / metal_rate:.3f} ({rates}, Kubernetes backend / bare-metal backend)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
