"""What the gateway and an app's tunnel add to a call to a model served on the tenant's own GPU pools: the
same OpenAI-compatible server called directly and through the gateway, in the same run.

Starts a real Klique (`klique web` and a worker, on a fresh database with the demo tenant), a bare-metal
agent, and a model endpoint from a catalogue entry: the gateway's echo server (gateway/echo.py), standing
in for vLLM with the same API. Then sends sequential keep-alive chat completions of a few tokens:

- baseline: POST /v1/chat/completions to the model server's port on this host, directly;
- Klique:   POST /v1/chat/completions to the tenant's gateway with a Klique token, which checks the
            caller, holds the budget, calls the model through the app's tunnel (the channel layer and the
            agent), settles and writes the usage.

Prints requests per second and p50/p99 latency of both, the latency Klique adds, and
`ratio: <gateway rps> / <direct rps>`.
Usage: .venv/bin/python bench/model_endpoint.py [--requests 1000]
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does).
"""

from __future__ import annotations

import argparse
import sys

import httpx
from app_route import app_running, measure, report
from scratch import ROOT

ECHO = "import sys; sys.path.insert(0, sys.argv.pop(1)); from gateway.echo import main; main()"
ENTRY = {
    "name": "echo-model",
    "version": "1",
    "kind": "model",
    "command": [sys.executable, "-c", ECHO, str(ROOT), "--port", "{port}"],
    "health": {"path": "/v1/models"},
    "gpus": "1",
    "compute_resource": "Apps",
    "serves": {"model": "tiny-echo", "mode": "chat"},
}
CALL = {"model": "tiny-echo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    with app_running(ENTRY, {}) as (port, demo, app), httpx.Client(timeout=60) as client:
        url = f"http://127.0.0.1:{app['port']}/v1/chat/completions"
        direct_rps, direct = measure(client, url, {}, args.requests, CALL)
        gateway = {"Host": f"demo.localhost:{port}", "Authorization": f"Bearer {demo['admin_token']}"}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        gateway_rps, through = measure(client, url, gateway, args.requests, CALL)
    print(f"calls: {args.requests} each, sequential, one keep-alive connection, one web process")
    report(
        [
            ("baseline  the model server directly", direct_rps, direct),
            ("Klique    the gateway, through the tunnel", gateway_rps, through),
        ],
        "the gateway and the tunnel",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
