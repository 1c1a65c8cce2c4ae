"""How much an authenticated tenant request costs on top of the bare web stack.

Starts a real `klique web` (uvicorn, one process) on a fresh database with the demo tenant, then sends
sequential keep-alive requests to two endpoints of that same process:

- baseline: GET /healthz, answered by the first middleware (no tenant lookup, no token, no DRF);
- Klique:   GET /api/v1/me/ on the tenant's domain: tenant resolution by Host, bearer-token check
            against the tenant's schema, RBAC, DRF rendering: the path every API call takes.

Prints requests per second and median latency for both, then `ratio: <Klique rps> / <baseline rps>`.
Usage: .venv/bin/python bench/request_path.py [--requests 2000]
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx
from scratch import klique_web, scratch_klique


def measure(client: httpx.Client, url: str, headers: dict[str, str], count: int) -> tuple[float, float]:
    for _ in range(50):  # warm up connections and caches
        client.get(url, headers=headers).raise_for_status()
    latencies = []
    started = time.perf_counter()
    for _ in range(count):
        before = time.perf_counter()
        client.get(url, headers=headers).raise_for_status()
        latencies.append(time.perf_counter() - before)
    elapsed = time.perf_counter() - started
    return count / elapsed, statistics.median(latencies) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()

    with (
        scratch_klique(redis_db=11) as (environment, demo),
        klique_web(environment, args.port) as base,
        httpx.Client(timeout=10) as client,
    ):
        baseline_rps, baseline_ms = measure(client, f"{base}/healthz", {}, args.requests)
        tenant = {"Host": f"demo.localhost:{args.port}", "Authorization": f"Bearer {demo['admin_token']}"}
        klique_rps, klique_ms = measure(client, f"{base}/api/v1/me/", tenant, args.requests)

    print(f"requests per endpoint: {args.requests}, sequential, one keep-alive connection, one web process")
    print(f"{'':34}{'req/s':>10}{'median ms':>12}")
    print(f"{'baseline  GET /healthz':34}{baseline_rps:>10.0f}{baseline_ms:>12.2f}")
    print(f"{'Klique    GET /api/v1/me/ (tenant)':34}{klique_rps:>10.0f}{klique_ms:>12.2f}")
    print(f"ratio: {klique_rps / baseline_rps:.3f} ({klique_rps:.0f} / {baseline_rps:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
