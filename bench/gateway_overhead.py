"""What the LLM gateway adds to a call, beside what LiteLLM's own proxy adds, on one local upstream.

One run starts three servers on this machine:

- the upstream: gateway.echo (uvicorn, one process), an OpenAI-compatible model server that answers at
  once, so what is measured is the gateway, not a model;
- Klique: a real `klique web` (one process) on a fresh database with the demo tenant, its gateway
  configured with one model on that upstream, with budgets and metering on: a tenant budget and a project
  wallet, so every call holds, settles and writes its usage row;
- LiteLLM's proxy (`litellm --config`, one worker, as LiteLLM runs it), installed from PyPI into
  .klique/bench/litellm-proxy (litellm[proxy]==1.108.7) the first time, with the same model.

Then the same chat completions (non-streamed, 16 tokens of reply) go, at the same fixed concurrency from
one client process, straight to the upstream, through Klique, and through LiteLLM. It prints p50 and p95
latency and requests per second for each, what each gateway adds to the upstream's p50 and p95, and
`ratio: <Klique's added p50> / <LiteLLM's added p50>` (the target is at most 0.25).

Usage: .venv/bin/python bench/gateway_overhead.py [--requests 3000] [--concurrency 16]
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does) and PyPI for the first run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from scratch import KLIQUE, ROOT, free_port, scratch_klique

LITELLM_VERSION = "1.108.7"
PROXY_VENV = ROOT / ".klique" / "bench" / "litellm-proxy"
MASTER_KEY = "sk-bench-master"
UPSTREAM_KEY = "sk-bench-upstream"
BODY = {
    "model": "chat",
    "messages": [{"role": "user", "content": "how fast is the gateway"}],
    "max_tokens": 16,
}


def wait_for(url: str, process: subprocess.Popen[bytes], headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server for {url} exited with {process.returncode}")
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within 180 s")


@contextmanager
def running(
    argv: list[str], environment: dict[str, str], cwd: Path = ROOT
) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        argv, env=environment, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def litellm_proxy() -> Path:
    """LiteLLM's proxy in a virtual environment of its own (its extras pin versions Klique does not use)."""
    binary = PROXY_VENV / "bin" / "litellm"
    if not binary.exists():
        print(f"installing litellm[proxy]=={LITELLM_VERSION} into {PROXY_VENV} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(PROXY_VENV)], check=True)
        pip = [str(PROXY_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, f"litellm[proxy]=={LITELLM_VERSION}"], check=True)
    return binary


async def load(
    url: str, headers: dict[str, str], requests: int, concurrency: int
) -> tuple[list[float], float]:
    """Latencies (seconds) of `requests` calls made `concurrency` at a time, and the wall time they took."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        for _ in range(max(concurrency * 4, 100)):  # warm up connections, caches, counters
            (await client.post(url, json=BODY, headers=headers)).raise_for_status()
        latencies: list[float] = []
        remaining = iter(range(requests))

        async def worker() -> None:
            for _ in remaining:
                started = time.perf_counter()
                response = await client.post(url, json=BODY, headers=headers)
                latencies.append(time.perf_counter() - started)
                response.raise_for_status()

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - began


def figures(latencies: list[float], elapsed: float) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "p50": statistics.median(ordered) * 1000,
        "p95": ordered[int(len(ordered) * 0.95)] * 1000,
        "rps": len(ordered) / elapsed,
    }


def configure_klique(base: str, host: str, admin_token: str, upstream: str) -> None:
    headers = {"Host": host, "Authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=base, headers=headers, timeout=30) as api:
        api.post("/api/v1/secrets/", json={"scope": "tenant", "name": "UPSTREAM_KEY", "value": UPSTREAM_KEY})
        chat = {
            "model_name": "chat",
            "litellm_params": {
                "model": "openai/echo",
                "api_base": upstream,
                "api_key_secret": "UPSTREAM_KEY",
            },
            "model_info": {"input_cost_per_million": 0.15, "output_cost_per_million": 0.6},
        }
        api.put("/api/v1/gateway/", json={"document": {"model_list": [chat]}}).raise_for_status()
        budgets = [
            {"scope": "tenant", "unit": "tokens", "limit": 10**12, "period": "month"},
            {"scope": "user", "user": "alice", "unit": "usd", "limit": 10**6, "period": "none"},
        ]
        for budget in budgets:
            api.post("/api/v1/gateway/budgets/", json=budget).raise_for_status()


def proxy_config(path: Path, upstream: str) -> None:
    path.write_text(
        "model_list:\n"
        "  - model_name: chat\n"
        "    litellm_params:\n"
        "      model: openai/echo\n"
        f"      api_base: {upstream}\n"
        f"      api_key: {UPSTREAM_KEY}\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    proxy = litellm_proxy()
    upstream_port, klique_port, proxy_port = free_port(), free_port(), free_port()
    upstream = f"http://127.0.0.1:{upstream_port}/v1"
    quiet = {**os.environ, "ECHO_API_KEY": UPSTREAM_KEY}
    results: dict[str, dict[str, float]] = {}
    with (
        scratch_klique(redis_db=12, KLIQUE_OUTBOUND_ALLOW="127.0.0.0/8") as (environment, demo),
        running([sys.executable, "-m", "gateway.echo", "--port", str(upstream_port)], quiet) as echo,
        running([*KLIQUE, "web", "--port", str(klique_port)], environment) as web,
    ):
        wait_for(f"{upstream}/models", echo, {"Authorization": f"Bearer {UPSTREAM_KEY}"})
        wait_for(f"http://127.0.0.1:{klique_port}/healthz", web)
        host = f"{demo['tenant']}.localhost"
        configure_klique(f"http://127.0.0.1:{klique_port}", host, demo["admin_token"], upstream)
        config = ROOT / ".klique" / "bench" / "litellm-proxy.yaml"
        proxy_config(config, upstream)
        proxy_environment = {
            **os.environ,
            "LITELLM_MASTER_KEY": MASTER_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
        }
        proxy_argv = [str(proxy), "--config", str(config), "--port", str(proxy_port), "--num_workers", "1"]
        with running(proxy_argv, proxy_environment) as litellm:
            wait_for(f"http://127.0.0.1:{proxy_port}/health/liveliness", litellm)
            targets: list[tuple[str, str, dict[str, str]]] = [
                ("upstream", f"{upstream}/chat/completions", {"Authorization": f"Bearer {UPSTREAM_KEY}"}),
                (
                    "Klique",
                    f"http://127.0.0.1:{klique_port}/v1/chat/completions",
                    {"Host": host, "Authorization": f"Bearer {demo['admin_token']}"},
                ),
                (
                    "LiteLLM",
                    f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
                    {"Authorization": f"Bearer {MASTER_KEY}"},
                ),
            ]
            for name, url, headers in targets:
                latencies, elapsed = asyncio.run(load(url, headers, args.requests, args.concurrency))
                results[name] = figures(latencies, elapsed)

    base = results["upstream"]
    print(f"{args.requests} chat completions per target, {args.concurrency} at a time, one client process")
    print(f"{'':10}{'p50 ms':>9}{'p95 ms':>9}{'req/s':>9}{'added p50':>11}{'added p95':>11}")
    added: dict[str, float] = {}
    for name, row in results.items():
        added[name] = row["p50"] - base["p50"]
        extra = "" if name == "upstream" else f"{added[name]:>11.2f}{row['p95'] - base['p95']:>11.2f}"
        print(f"{name:10}{row['p50']:>9.2f}{row['p95']:>9.2f}{row['rps']:>9.0f}{extra}")
    print("Klique with budgets (a tenant budget and a wallet held and settled per call) and metering on;")
    print("LiteLLM's proxy with its defaults (no database: no spend tracking).")
    ratio = added["Klique"] / added["LiteLLM"]
    print(f"ratio: {ratio:.3f} ({added['Klique']:.2f} ms / {added['LiteLLM']:.2f} ms added p50)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
