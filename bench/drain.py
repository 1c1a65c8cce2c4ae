"""Drain N trivial tasks through one Klique agent, and the same N `sbatch --wrap true` jobs through a real
single-node Slurm on this machine, at the same concurrency; print tasks per second for both, their ratio,
and Klique's submit-to-dispatch p50/p99.

Klique: a fresh database, `klique web`, `klique worker` and one bare-metal agent serving a pool of
`--concurrency` GPUs; the tasks (1 GPU each, `true`) are submitted through the API in batches. Slurm: the
single node of deploy/slurm/single-node.sh, once as it comes (its cores run one job each) and once tuned for
throughput (`single-node.sh start DIR tuned`: 64 CPUs declared, the scheduler run at every submission and end,
accounting off); its jobs are submitted one by one, as a user would.
Usage: .venv/bin/python bench/drain.py [--tasks 600] [--slurm-jobs 1000] [--default-slurm-jobs 100]
                                       [--concurrency 64] [--slurm both|default|tuned|none]
Needs PostgreSQL and Redis on 127.0.0.1, and root for Slurm (it is installed if missing).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from scratch import KLIQUE, ROOT, dispatch_latency, free_port, scratch_klique

PROBES = 30  # tasks submitted one at a time into an idle pool, for submit-to-dispatch latency


def completed(client: httpx.Client) -> int:
    query: dict[str, str | int] = {"state": "completed", "compute_resource": "Drain", "limit": 1}
    return int(client.get("/api/v1/tasks/", params=query).json()["count"])


def free_capacity_latency(client: httpx.Client, database_url: str) -> tuple[float, float]:
    """Submit-to-dispatch p50 and p99, in seconds, of tasks sent one at a time into the idle pool."""
    # With free capacity: one task at a time into the idle pool, each waited for.
    for index in range(PROBES):
        task = client.post(
            "/api/v1/tasks/",
            json={"compute_resource": "Drain", "name": f"probe-{index}", "spec": {"command": ["true"]}},
        ).json()
        while client.get(f"/api/v1/tasks/{task['id']}/").json()["state"] != "completed":
            time.sleep(0.05)
    return dispatch_latency(database_url, "probe-%")


def klique_drain(count: int, concurrency: int, work: Path) -> tuple[float, float, float]:
    """Seconds to drain, and submit-to-dispatch p50 and p99 in seconds with free capacity."""
    with scratch_klique(redis_db=12, KLIQUE_CYCLE_DEBOUNCE_MS="100") as (environment, demo):
        port = free_port()
        headers = {"Host": f"demo.localhost:{port}", "Authorization": f"Bearer {demo['admin_token']}"}
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": ROOT, "env": environment}
        children: list[subprocess.Popen[bytes]] = []
        try:
            children.append(subprocess.Popen([*KLIQUE, "web", "--port", str(port)], **quiet))  # type: ignore[call-overload]
            children.append(subprocess.Popen([*KLIQUE, "worker", "--concurrency", "1"], **quiet))  # type: ignore[call-overload]
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60)
            for _ in range(300):
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            token_file = work / "agent.token"
            token_file.write_text(drain_pool_token(client, concurrency))
            token_file.chmod(0o600)
            agent = [
                sys.executable,
                "-m",
                "agents.main",
                "--url",
                f"http://demo.localhost:{port}",
                "--token-file",
                str(token_file),
                "--gpus",
                str(concurrency),
                "--agent-id",
                "drain",
                "--work-dir",
                str(work / "agent"),
            ]
            children.append(subprocess.Popen(agent, **quiet))  # type: ignore[call-overload]
            for _ in range(300):
                if any(
                    p["name"] == "drain" and p["online"]
                    for p in client.get("/api/v1/pools/").json()["results"]
                ):
                    break
                time.sleep(0.1)
            started = time.perf_counter()
            for first in range(0, count, 1000):
                batch = [{"compute_resource": "Drain", "spec": {"command": ["true"]}}] * min(
                    1000, count - first
                )
                client.post("/api/v1/tasks/", json=batch).raise_for_status()
            deadline = time.monotonic() + 3600
            while completed(client) < count and time.monotonic() < deadline:
                time.sleep(0.2)
            elapsed = time.perf_counter() - started
            p50, p99 = free_capacity_latency(client, environment["DATABASE_URL"])
            return elapsed, p50, p99
        finally:
            for child in reversed(children):
                child.terminate()
                child.wait(timeout=30)


def drain_pool_token(client: httpx.Client, concurrency: int) -> str:
    """Provision a pool "drain" of `concurrency` GPUs with compute resource "Drain"; an agent token for it."""
    document = client.get("/api/v1/configuration/draft/").json()["document"]
    document["pools"].append({"name": "drain", "environment": "baremetal", "capacity_gpus": concurrency})
    document["profiles"].append({"name": "one", "gpus": "1", "pools": [{"pool": "drain"}]})
    document["policies"][0]["limit_gpus"] = str(10_000)
    document["policies"][0]["compute_resources"].append({"profile": "one", "name": "Drain"})
    client.put("/api/v1/configuration/draft/", json={"document": document}).raise_for_status()
    client.post("/api/v1/configuration/draft/provision/").raise_for_status()
    pool = next(p for p in client.get("/api/v1/pools/").json()["results"] if p["name"] == "drain")
    token: str = client.post(f"/api/v1/pools/{pool['id']}/agent-tokens/", json={"name": "drain"}).json()[
        "token"
    ]
    return token


def slurm_drain(count: int, work: Path, profile: str) -> float:
    """Seconds for the single-node Slurm of `profile` (default or tuned) to run `count` `sbatch --wrap true`
    jobs submitted one by one, as a user would."""
    script = str(ROOT / "deploy" / "slurm" / "single-node.sh")
    folder = str(work / f"slurm-{profile}")
    started = subprocess.run([script, "start", folder, profile], check=True, capture_output=True, text=True)
    environment = {**os.environ, "SLURM_CONF": started.stdout.strip().splitlines()[-1]}
    try:
        began = time.perf_counter()
        for _ in range(count):
            subprocess.run(
                ["sbatch", "--quiet", "--wrap", "true", "-o", "/dev/null"], env=environment, check=True
            )
        deadline = time.monotonic() + 3600
        while (
            time.monotonic() < deadline
            and subprocess.run(
                ["squeue", "-h"], env=environment, capture_output=True, text=True, check=True
            ).stdout.strip()
        ):
            time.sleep(0.2)
        return time.perf_counter() - began
    finally:
        subprocess.run([script, "stop", folder], check=False)
        time.sleep(1)  # let slurmctld save its state and exit before its folder goes


SLURM_LABELS = {
    "default": "Slurm, default (sbatch --wrap)",
    "tuned": "Slurm, tuned (sbatch --wrap)",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=600, help="tasks through Klique")
    parser.add_argument("--slurm-jobs", type=int, default=1000, help="jobs through the tuned Slurm")
    parser.add_argument(
        "--default-slurm-jobs",
        type=int,
        default=100,
        help="jobs through the default Slurm (it starts about one a second: 1,000 would take a quarter hour)",
    )
    parser.add_argument("--concurrency", type=int, default=64, help="GPUs of Klique's pool")
    parser.add_argument(
        "--slurm",
        choices=("both", "default", "tuned", "none"),
        default="both",
        help="which Slurm configurations run beside Klique (the ratio is against the tuned one when it runs)",
    )
    args = parser.parse_args()
    profiles = {"both": ["default", "tuned"], "none": []}.get(args.slurm, [args.slurm])
    with tempfile.TemporaryDirectory(prefix="klique-drain-", ignore_cleanup_errors=True) as folder:
        work = Path(folder)
        klique_seconds, p50, p99 = klique_drain(args.tasks, args.concurrency, work)
        jobs = {"tuned": args.slurm_jobs, "default": args.default_slurm_jobs}
        print(
            f"Klique: {args.tasks} tasks in {klique_seconds:.1f} s; Slurm: {', '.join(profiles) or 'none'}",
            flush=True,
        )
        slurm = {profile: slurm_drain(jobs[profile], work, profile) for profile in profiles}
    klique_rate = args.tasks / klique_seconds
    print(f"trivial tasks, Klique at concurrency {args.concurrency}")
    print(f"{'':34}{'tasks':>8}{'seconds':>10}{'tasks/s':>10}")
    print(f"{'Klique (one bare-metal agent)':34}{args.tasks:>8}{klique_seconds:>10.1f}{klique_rate:>10.1f}")
    for profile, seconds in slurm.items():
        rate = jobs[profile] / seconds
        print(f"{SLURM_LABELS[profile]:34}{jobs[profile]:>8}{seconds:>10.1f}{rate:>10.1f}")
    print(
        f"Klique submit-to-dispatch with free capacity ({PROBES} tasks): "
        f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
    )
    if not slurm:
        print(f"ratio: 1.000 ({klique_rate:.1f} / {klique_rate:.1f} tasks/s, no Slurm run: Klique alone)")
        return 0
    peer = "tuned" if "tuned" in slurm else "default"
    peer_rate = jobs[peer] / slurm[peer]
    rates = f"{klique_rate:.1f} / {peer_rate:.1f} tasks/s"
    print(f"ratio: {klique_rate / peer_rate:.3f} ({rates}, Klique / Slurm {peer})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
