"""The MCP server at a tenant's /mcp, through the official MCP client (the `mcp` SDK's `Client` over
streamable HTTP) against two real `klique web` processes of one `klique up --demo`: a task submitted
through one process is followed through the other (status, why, logs) and ends; an AI agent's delegated
token acts within its own quota and is audited as the agent for its user; a viewer's and a read-scope
token's writes, another tenant's or an unknown task, a revoked token, bad and huge arguments are refused
with words a model can act on, and nothing is submitted by a refused call."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.e2e.conftest import ROOT, Running, clean_environment, free_port, start_up
from tests.e2e.test_agent_crash import Demo
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

PRINTS = "import time\nfor step in range(3):\n    print(f'step {step}', flush=True)\n    time.sleep(0.2)\n"


@asynccontextmanager
async def mcp_client(port: int, token: str) -> AsyncIterator[Client]:
    """The SDK's client on a web process, the tenant's address in the Host header, the token as bearer."""
    http = httpx2.AsyncClient(
        headers={"Host": f"demo.localhost:{port}", "Authorization": f"Bearer {token}"}, timeout=30
    )
    async with (
        http,
        Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http)) as client,
    ):
        yield client


async def call(port: int, token: str, tool: str, arguments: dict[str, Any] | None = None) -> tuple[bool, Any]:
    """(is_error, the structured answer or the error's text) of one tool call."""
    async with mcp_client(port, token) as client:
        result = await client.call_tool(tool, arguments or {})
    if result.is_error:
        return True, " ".join(getattr(block, "text", "") for block in result.content)
    return False, result.structured_content


def tool(port: int, token: str, tool_name: str, /, **arguments: Any) -> Any:
    failed, answer = asyncio.run(call(port, token, tool_name, arguments))
    assert not failed, answer
    return answer


def refused(port: int, token: str, tool_name: str, /, **arguments: Any) -> str:
    failed, answer = asyncio.run(call(port, token, tool_name, arguments))
    assert failed, answer
    return str(answer)


def raw(port: int, token: str | None, body: bytes | dict[str, Any], path: str = "/mcp") -> httpx.Response:
    headers = {
        "Host": f"demo.localhost:{port}",
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-11-25",
    }
    if token:
        headers["Authorization"] = f"Bearer {token}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"http://127.0.0.1:{port}{path}", headers=headers, content=content, timeout=30)


@pytest.fixture
def plane(fresh_database: str, redis_url: str, tmp_path: Path) -> Iterator[tuple[Running, int, Demo]]:
    """`klique up --demo`, and a second web process on the same database and Redis."""
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    second_port = free_port()
    second = subprocess.Popen(
        [sys.executable, "-m", "klique.cli", "web", "--port", str(second_port)],
        cwd=ROOT,
        env={**environment, "KLIQUE_DATA_DIR": str(tmp_path / "data")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{second_port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        while time.monotonic() < deadline:  # the demo's own tasks are done: its pool's GPUs are free
            listed = demo.call("GET", "/api/v1/tasks/?state=completed")["count"]
            if listed >= 2:
                break
            time.sleep(0.5)
        yield running, second_port, demo
    finally:
        second.terminate()
        second.wait(30)
        assert running.interrupt() == 0


def test_an_agent_submits_through_one_web_process_and_follows_through_the_other(
    plane: tuple[Running, int, Demo],
) -> None:
    running, second, demo = plane
    first = running.port
    agent = demo.call(
        "POST",
        "/api/v1/tokens/",
        json={"name": "claude", "agent": "claude", "scope": "submit", "gpu_quota": "4"},
    )["token"]

    async def listed() -> set[str]:
        async with mcp_client(first, agent) as client:
            return {item.name for item in (await client.list_tools()).tools}

    assert asyncio.run(listed()) >= {
        "list_compute_resources", "submit_task", "task_status", "why_pending", "task_logs", "cancel_task",
        "list_tasks",
    }  # fmt: skip
    resources = tool(first, agent, "list_compute_resources")["compute_resources"]
    four = next(row for row in resources if row["name"] == "Research: 4 GPUs")
    assert (four["size"], four["reservation_gpus"], four["limit_gpus"]) == ("4 GPUs", "8", "16")

    task = tool(first, agent, "submit_task", compute_resource="Research: 4 GPUs",
                command=[sys.executable, "-c", PRINTS], name="from an agent")  # fmt: skip
    assert task["submitter"] == "alice"
    assert task["submitted_by_agent"] == "claude"
    deadline = time.monotonic() + 90
    status = tool(second, agent, "task_status", task_id=task["id"])
    while status["state"] not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        status = tool(second, agent, "task_status", task_id=task["id"])
    assert status["state"] == "completed", (status, demo.call("GET", "/api/v1/tasks/")["results"])
    logs = tool(second, agent, "task_logs", task_id=task["id"])
    assert [line for line in logs["lines"] if "step" in line] == [
        f"[stdout] step {step}" for step in range(3)
    ]
    assert logs["ended"] is True
    assert tool(second, agent, "task_logs", task_id=task["id"], after=logs["next_after"])["lines"] == []
    why = tool(second, agent, "why_pending", task_id=task["id"])
    assert why["state"] == "completed"
    mine = tool(second, agent, "list_tasks")["tasks"]
    assert task["id"] in {row["id"] for row in mine}
    rest = demo.call("GET", f"/api/v1/tasks/{task['id']}/")
    assert (rest["state"], rest["submitted_by_agent"]) == ("completed", "claude")  # one truth, two ways in

    # Within its own quota: 4 GPUs held by a waiting task leave none for a second one.
    holding = tool(first, agent, "submit_task", compute_resource="Research: 4 GPUs",
                   command=[sys.executable, "-c", "import time; time.sleep(60)"])  # fmt: skip
    said = refused(second, agent, "submit_task", compute_resource="Research: 4 GPUs", command=["true"])
    assert "quota" in said, said
    cancelled = tool(second, agent, "cancel_task", task_id=holding["id"])
    assert cancelled["state"] == "aborted"
    audit = demo.call("GET", "/api/v1/audit/?limit=200")["results"]
    acted = [row for row in audit if row["action"] in ("mcp.submit_task", "mcp.cancel_task")]
    assert {(row["actor"], row["on_behalf_of"]) for row in acted} == {("agent claude for alice", "alice")}
    assert len(acted) == 3


def test_refusals_are_tool_errors_a_model_can_act_on_and_submit_nothing(
    plane: tuple[Running, int, Demo],
) -> None:
    running, second, demo = plane
    port = running.port
    before = demo.call("GET", "/api/v1/tasks/?limit=1")["count"]
    account = demo.call("POST", "/api/v1/service-accounts/", json={"name": "watcher", "role": "viewer"})
    viewer = demo.call("POST", f"/api/v1/service-accounts/{account['id']}/tokens/", json={"name": "w"})[
        "token"
    ]
    reader = demo.call("POST", "/api/v1/tokens/", json={"name": "reader", "scope": "read"})["token"]
    admin = demo.token

    said = refused(port, viewer, "submit_task", compute_resource="Research: 4 GPUs", command=["true"])
    assert "needs the member role" in said
    said = refused(second, reader, "submit_task", compute_resource="Research: 4 GPUs", command=["true"])
    assert "scope read" in said
    assert "may only read" in said
    assert tool(port, reader, "list_tasks", mine=False)["tasks"]  # reading is what it may do
    said = refused(port, admin, "submit_task", compute_resource="Nowhere", command=["true"])
    assert "Nowhere" in said
    for unknown in (str(uuid.uuid4()), "../../etc/passwd", "1 OR 1=1"):
        said = refused(port, admin, "task_status", task_id=unknown)
        assert "list_tasks shows the tasks you may see" in said
    bad_arguments: list[dict[str, Any]] = [
        {"command": "rm -rf /"},
        {"command": [1, 2]},
        {"command": []},
        {"gpus": "lots", "command": ["true"]},
    ]
    for bad in bad_arguments:
        failed, answer = asyncio.run(
            call(port, admin, "submit_task", {"compute_resource": "Research: 4 GPUs", **bad})
        )
        assert failed, (bad, answer)
    failed, answer = asyncio.run(call(port, admin, "no_such_tool", {}))
    assert failed
    assert "no_such_tool" in str(answer)
    assert demo.call("GET", "/api/v1/tasks/?limit=1")["count"] == before  # nothing was submitted

    # A model that calls submit_task twice with one idempotency key gets one task, through either process.
    keyed = {"compute_resource": "Research: 4 GPUs", "command": ["true"], "idempotency_key": "plan-7"}
    once = tool(port, admin, "submit_task", **keyed)
    assert tool(second, admin, "submit_task", **keyed)["id"] == once["id"]
    assert demo.call("GET", "/api/v1/tasks/?limit=1")["count"] == before + 1

    huge = raw(port, admin, b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"x": "'
               + b"a" * (2 * 1024 * 1024) + b'"}}')  # fmt: skip
    assert huge.status_code == 413


def test_without_a_usable_token_the_answer_is_401_naming_the_resource_metadata(
    plane: tuple[Running, int, Demo],
) -> None:
    running, second, demo = plane
    port = running.port
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    anonymous = raw(port, None, ping)
    assert anonymous.status_code == 401
    challenge = anonymous.headers["www-authenticate"]
    assert challenge.startswith("Bearer resource_metadata=")
    metadata_url = challenge.split('"')[1]
    assert metadata_url == f"http://demo.localhost:{port}/.well-known/oauth-protected-resource/mcp"
    metadata = httpx.get(
        f"http://127.0.0.1:{port}/.well-known/oauth-protected-resource/mcp",
        headers={"Host": f"demo.localhost:{port}"},
        timeout=10,
    ).json()
    assert metadata["resource"] == f"http://demo.localhost:{port}/mcp"
    assert metadata["bearer_methods_supported"] == ["header"]
    assert raw(port, "klq_nonsense", ping).headers["www-authenticate"].count('error="invalid_token"') == 1

    issued = demo.call(
        "POST", "/api/v1/tokens/", json={"name": "soon-revoked", "agent": "bot", "scope": "read"}
    )
    assert tool(second, issued["token"], "list_tasks")["tasks"] is not None
    stopped = demo.call("POST", f"/api/v1/delegations/{issued['id']}/revoke/", json={})  # the agent, stopped
    assert stopped["active"] is False
    for web in (port, second):  # refused at once, in every process
        answer = raw(web, issued["token"], ping)
        assert answer.status_code == 401
        assert "revoked" in answer.headers["www-authenticate"]
    elsewhere = httpx.post(
        f"http://127.0.0.1:{port}/mcp",
        headers={"Host": f"nowhere.localhost:{port}", "Authorization": f"Bearer {demo.token}"},
        json=ping,
        timeout=10,
    )
    assert elsewhere.status_code == 404


async def _read(port: int, token: str, uri: str) -> tuple[bool, Any]:
    """(failed, the contents' text or bytes, or the error's words) of one resource read."""
    async with mcp_client(port, token) as client:
        try:
            result = await client.read_resource(uri)
        except MCPError as error:
            return True, str(error)
    (content,) = result.contents
    return False, getattr(content, "text", None) or getattr(content, "blob", None)


def read(port: int, token: str, uri: str) -> Any:
    failed, answer = asyncio.run(_read(port, token, uri))
    assert not failed, answer
    return answer


WRITES = (
    "import json, pathlib\n"
    "for step in range(3):\n    print(f'epoch {step}', flush=True)\n"
    "pathlib.Path('metrics.json').write_text(json.dumps({'loss': 0.25}))\n"
)


def test_usage_budgets_previews_resources_and_prompts_agree_with_the_api(
    plane: tuple[Running, int, Demo],
) -> None:
    running, second, demo = plane
    port, admin = running.port, demo.token

    # usage_summary: the usage API's own figures, this month.
    since = datetime.now(UTC).date().replace(day=1).isoformat() + "T00:00:00+00:00"
    rest = demo.call("GET", "/api/v1/usage/summary/", params={"by": "kind", "since": since})
    everyone = tool(port, admin, "usage_summary", by="kind", everyone=True)
    assert (everyone["rows"], everyone["total_cost_usd"]) == (rest["rows"], rest["total_cost_usd"])
    assert any(row["kind"] == "gpu" and row["gpu_hours"] != "0.000000" for row in everyone["rows"])
    assert tool(second, admin, "usage_summary")["who"] == "alice"

    # budget_status: what the budgets API says is spent, and what is left.
    made = demo.call(
        "POST", "/api/v1/gateway/budgets/",
        json={"scope": "user", "user": "alice", "unit": "tokens", "limit": "5000", "period": "month"},
    )  # fmt: skip
    budgets = tool(second, admin, "budget_status")["budgets"]
    (mine,) = [row for row in budgets if row["name"] == "alice's monthly budget"]
    assert (mine["limit"], mine["spent"], mine["held"]) == ("5000", made["spent"], "0")
    assert int(mine["left"]) == 5000 - int(made["spent"])

    # preview_batch_script: the configuration API's preview, rendered the same.
    four = next(row for row in tool(port, admin, "list_compute_resources")["compute_resources"]
                if row["name"] == "Research: 4 GPUs")  # fmt: skip
    preview = tool(port, admin, "preview_batch_script", compute_resource="Research: 4 GPUs",
                   command=["python", "train.py", "--lr", "1e-3; rm -rf /"])  # fmt: skip
    assert preview["scheduler"] == "slurm"
    assert "#SBATCH" in preview["script"]
    assert "'1e-3; rm -rf /'" in preview["script"]  # an argument stays one argument
    api_preview = demo.call(
        "POST", f"/api/v1/compute-resources/{four['id']}/batch-preview/",
        json={"spec": {"command": ["python", "train.py", "--lr", "1e-3; rm -rf /"]}},
    )  # fmt: skip
    assert (preview["script"], preview["submit"]) == (api_preview["script"], api_preview["submit"])

    # Resources: a task's log, its outputs and one of them; the policies that apply.
    task = tool(port, admin, "submit_task", compute_resource="Research: 4 GPUs",
                command=[sys.executable, "-c", WRITES], outputs=["metrics.json"])  # fmt: skip
    deadline = time.monotonic() + 90
    while tool(second, admin, "task_status", task_id=task["id"])["state"] != "completed":
        assert time.monotonic() < deadline, tool(second, admin, "task_status", task_id=task["id"])
        time.sleep(0.5)
    log = read(second, admin, f"klique://tasks/{task['id']}/logs")
    assert [line for line in log.splitlines() if "epoch" in line] == [f"[stdout] epoch {n}" for n in range(3)]
    listed = json.loads(read(port, admin, f"klique://tasks/{task['id']}/outputs"))["outputs"]
    assert [(row["name"], row["uri"]) for row in listed] == [
        ("metrics.json", f"klique://tasks/{task['id']}/outputs/metrics.json")
    ]
    assert json.loads(read(second, admin, listed[0]["uri"])) == {"loss": 0.25}
    policies = json.loads(read(port, admin, "klique://users/me/policies"))["policies"]
    research = next(row for row in policies if row["group"] == "research")
    assert "Research: 4 GPUs" in research["resources"]
    account = demo.call("POST", "/api/v1/service-accounts/", json={"name": "peeker", "role": "viewer"})
    viewer = demo.call("POST", f"/api/v1/service-accounts/{account['id']}/tokens/", json={"name": "p"})[
        "token"
    ]
    refusals = {
        "klique://users/alice/policies": "You may read your own policies",
        f"klique://tasks/{uuid.uuid4()}/logs": "list_tasks shows the tasks you may see",
        f"klique://tasks/{task['id']}/logs": "Only alice and tenant admins read what this task wrote.",
        f"klique://tasks/{task['id']}/outputs/metrics.json": "may not read the log or outputs of task",
    }
    for uri, words in refusals.items():  # a viewer: may read tasks, not what alice's task wrote
        failed, said = asyncio.run(_read(port, viewer, uri))
        assert failed, (uri, said)
        assert words in said, (uri, said)
    for uri, words in {
        f"klique://tasks/{task['id']}/outputs/missing.json": "has no output 'missing.json'",
        f"klique://tasks/{task['id']}/outputs/../../etc/passwd": "",  # the SDK's own path checks
        f"klique://tasks/{task['id']}/outputs/%2Fetc%2Fpasswd": "",
    }.items():
        failed, said = asyncio.run(_read(port, admin, uri))
        assert failed, (uri, said)
        assert words in said, (uri, said)

    # Prompts: listed, and "why is my task waiting" carries the scheduler's words.
    async def prompts() -> tuple[set[str], str]:
        async with mcp_client(port, admin) as client:
            names = {prompt.name for prompt in (await client.list_prompts()).prompts}
            got = await client.get_prompt("why_is_my_task_waiting", {"task_id": task["id"]})
        return names, " ".join(getattr(message.content, "text", "") for message in got.messages)

    names, text = asyncio.run(prompts())
    assert names == {"submit_a_training_run", "why_is_my_task_waiting"}
    assert '"state": "completed"' in text
    assert "budget_status" in text
