"""The MCP project's own conformance suite (npm @modelcontextprotocol/conformance, `server --url`, on the
Node.js 22 it needs, both pinned in tools/mcp-conformance) against a tenant's /mcp of `klique up --demo`,
through a small proxy that adds the bearer token the suite does not send.

Its scenarios that apply to any server pass: initialization, ping, listing tools, resources and prompts,
an unknown tool answered as a tool error, and DNS rebinding (a foreign Host is refused). The others do not
apply to Klique, and are listed in NOT_APPLICABLE with the reason."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.bearer_proxy import bearer_proxy
from tests.e2e.conftest import ROOT, clean_environment, start_up
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

SUITE = ROOT / "tools" / "mcp-conformance" / "node_modules" / ".bin"
APPLICABLE = [
    "server-initialize", "ping", "tools-list", "tools-call-error", "resources-list", "prompts-list",
    "dns-rebinding-protection",
]  # fmt: skip
FIXTURES = "calls the suite's own fixture: a tool, resource or prompt test_* of its reference server only"
NOT_APPLICABLE = {
    **dict.fromkeys(
        ["tools-call-simple-text", "tools-call-image", "tools-call-audio", "tools-call-embedded-resource",
         "tools-call-mixed-content", "tools-call-with-logging", "tools-call-with-progress",
         "json-schema-2020-12",
         "resources-read-text", "resources-read-binary", "resources-templates-read", "prompts-get-simple",
         "prompts-get-with-args", "prompts-get-embedded-resource", "prompts-get-with-image"],
        FIXTURES,
    ),
    **dict.fromkeys(
        ["tools-call-sampling", "tools-call-elicitation", "elicitation-sep1034-defaults",
         "elicitation-sep1330-enums"],
        "needs the server to send requests to the client mid-call; /mcp is stateless (any process answers)",
    ),
    **dict.fromkeys(
        ["resources-subscribe", "resources-unsubscribe", "server-sse-polling", "server-sse-multiple-streams"],
        "needs a session or an SSE stream held open; /mcp is stateless with JSON answers",
    ),
    "logging-set-level": "Klique declares no logging capability (a task's log is a tool and a resource)",
    "completion-complete": "Klique declares no completion capability",
}  # fmt: skip


@pytest.fixture
def mcp_url(fresh_database: str, redis_url: str, tmp_path: Path) -> Iterator[str]:
    if not (SUITE / "conformance").exists():
        pytest.fail("the MCP conformance suite is not installed: run `make install`")
    running = start_up(clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url), tmp_path / "data")
    try:
        token = running.wait_for(BANNER_CURL)[1]
        upstream, host = f"http://127.0.0.1:{running.port}", f"demo.localhost:{running.port}"
        with bearer_proxy(upstream=upstream, host=host, token=token) as base:
            yield f"{base}/mcp"
    finally:
        assert running.interrupt() == 0


def test_the_scenarios_that_apply_to_any_server_pass(mcp_url: str, tmp_path: Path) -> None:
    listed = subprocess.run(
        [str(SUITE / "conformance"), "list", "--server"], env=_environment(), capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout  # fmt: skip
    known = {line.strip()[2:].split(" ")[0] for line in listed.splitlines() if line.strip().startswith("- ")}
    assert known == set(APPLICABLE) | set(NOT_APPLICABLE), "the suite's scenarios changed: sort the new ones"

    failures = {}
    for scenario in APPLICABLE:
        folder = tmp_path / scenario
        done = subprocess.run(
            [str(SUITE / "conformance"), "server", "--url", mcp_url, "--scenario", scenario,
             "-o", str(folder)],
            env=_environment(), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        checks = [check for path in folder.glob("*/checks.json") for check in json.loads(path.read_text())]
        bad = [check for check in checks if check["status"] not in ("SUCCESS", "INFO")]
        if done.returncode or bad or not checks:
            failures[scenario] = (done.returncode, bad or done.stdout[-2000:])
    assert failures == {}


def _environment() -> dict[str, str]:
    return {**os.environ, "PATH": f"{SUITE}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
