"""How much an authenticated tenant request costs on top of the bare web stack.

Starts a real `klique web` (uvicorn, one process) on a fresh database with the demo tenant, then sends
sequential keep-alive requests to two endpoints of that same process:

- baseline: GET /healthz, answered by the first middleware (no tenant lookup, no token, no DRF);
- Klique:   GET /api/v1/me/ on the tenant's domain: tenant resolution by Host, bearer-token check
            against the tenant's schema, RBAC, DRF rendering: the path every API call takes.

The two are measured in alternating rounds (a round of each, ten times), so that both see the same moments
of a noisy machine. Prints requests per second and median latency for both, then
`ratio: <Klique rps> / <baseline rps>`.
Usage: .venv/bin/python bench/request_path.py [--requests 2000] [--rounds 10]
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx
from scratch import klique_web, scratch_klique


class Endpoint:
    """One endpoint's requests, timed one by one over the rounds."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url, self.headers = url, headers
        self.latencies: list[float] = []
        self.elapsed = 0.0

    def round(self, client: httpx.Client, count: int) -> None:
        started = time.perf_counter()
        for _ in range(count):
            before = time.perf_counter()
            client.get(self.url, headers=self.headers).raise_for_status()
            self.latencies.append(time.perf_counter() - before)
        self.elapsed += time.perf_counter() - started

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()

    with (
        scratch_klique(redis_db=11) as (environment, demo),
        klique_web(environment, args.port) as base,
        httpx.Client(timeout=10) as client,
    ):
        tenant = {"Host": f"demo.localhost:{args.port}", "Authorization": f"Bearer {demo['admin_token']}"}
        baseline = Endpoint(f"{base}/healthz", {})
        klique = Endpoint(f"{base}/api/v1/me/", tenant)
        for endpoint in (baseline, klique):  # warm up connections and caches
            Endpoint(endpoint.url, endpoint.headers).round(client, 50)
        per_round = max(1, args.requests // args.rounds)
        for _ in range(args.rounds):
            baseline.round(client, per_round)
            klique.round(client, per_round)
        baseline_rps, baseline_ms = baseline.rps, baseline.median_ms
        klique_rps, klique_ms = klique.rps, klique.median_ms

    print(
        f"requests per endpoint: {per_round * args.rounds} in {args.rounds} alternating rounds, sequential, "
        "one keep-alive connection, one web process"
    )
    print(f"{'':34}{'req/s':>10}{'median ms':>12}")
    print(f"{'baseline  GET /healthz':34}{baseline_rps:>10.0f}{baseline_ms:>12.2f}")
    print(f"{'Klique    GET /api/v1/me/ (tenant)':34}{klique_rps:>10.0f}{klique_ms:>12.2f}")
    print(f"ratio: {klique_rps / baseline_rps:.3f} ({klique_rps:.0f} / {baseline_rps:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
