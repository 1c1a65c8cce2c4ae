"""What the MCP server adds to a call: `task_status` through /mcp beside the same read through the REST API.

Starts a real `klique web` (uvicorn, one process, production settings) on a fresh database with the demo
tenant, submits one task, then sends sequential keep-alive requests to that same process:

- baseline: GET /api/v1/tasks/<id>/ (REST: tenant by Host, token, RBAC, DRF);
- Klique:   POST /mcp, a JSON-RPC `tools/call` of `task_status` for the same task, as the MCP SDK's client
            sends it in stateless streamable HTTP (tenant by Host, token, the SDK's dispatch, the tool).

Prints calls per second, p50 and p99 for both, then `ratio: <MCP p50> / <REST p50>`.
Usage: .venv/bin/python bench/mcp_calls.py [--calls 1000]
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import httpx
from scratch import klique_web, scratch_klique

MCP_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "application/json, text/event-stream",
    "MCP-Protocol-Version": "2025-11-25",
}


def measure(call: Callable[[], None], count: int) -> tuple[float, float, float]:
    for _ in range(50):  # warm up connections and caches
        call()
    latencies = []
    started = time.perf_counter()
    for _ in range(count):
        before = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - before)
    elapsed = time.perf_counter() - started
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return count / elapsed, statistics.median(latencies) * 1000, p99 * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--port", type=int, default=8767)
    args = parser.parse_args()

    with scratch_klique(redis_db=12) as (environment, demo), klique_web(environment, args.port) as base:
        tenant = {"Host": f"demo.localhost:{args.port}", "Authorization": f"Bearer {demo['admin_token']}"}
        with httpx.Client(timeout=10) as client:
            submitted = client.post(
                f"{base}/api/v1/tasks/",
                headers=tenant,
                json={"compute_resource": "Research: 4 GPUs", "spec": {"command": ["true"]}},
            )
            submitted.raise_for_status()
            task_id = submitted.json()["id"]
            call = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "tools/call",
                "params": {"name": "task_status", "arguments": {"task_id": task_id}},
            }
            body = json.dumps(call).encode()

            def rest() -> None:
                client.get(f"{base}/api/v1/tasks/{task_id}/", headers=tenant).raise_for_status()

            def mcp() -> None:
                answer = client.post(f"{base}/mcp", headers={**tenant, **MCP_HEADERS}, content=body)
                answer.raise_for_status()
                result = answer.json()["result"]
                if result.get("isError") or result["structuredContent"]["id"] != task_id:
                    raise SystemExit(f"task_status did not answer with the task: {result}")

            mcp()  # the answer is the task, before anything is timed
            rest_rps, rest_p50, rest_p99 = measure(rest, args.calls)
            mcp_rps, mcp_p50, mcp_p99 = measure(mcp, args.calls)

    print(f"calls per way in: {args.calls}, sequential, one keep-alive connection, one web process")
    print(f"{'':38}{'calls/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'REST GET /api/v1/tasks/<id>/':38}{rest_rps:>10.0f}{rest_p50:>10.2f}{rest_p99:>10.2f}")
    print(f"{'MCP  tools/call task_status':38}{mcp_rps:>10.0f}{mcp_p50:>10.2f}{mcp_p99:>10.2f}")
    print(f"ratio: {mcp_p50 / rest_p50:.3f} ({mcp_p50:.2f} / {rest_p50:.2f} ms p50, MCP / REST)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
