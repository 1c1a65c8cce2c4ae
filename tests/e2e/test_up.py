"""`klique up --demo` as a newcomer runs it: configured services, embedded ones, Ctrl-C, and a rerun."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest
import websockets
from celery import Celery

from tests.e2e.conftest import ROOT, Running, clean_environment, free_port, start_up

pytestmark = pytest.mark.e2e

BANNER_CURL = r"curl -H 'Authorization: Bearer (klq_\S+)' (http://\S+)"


def demo_curl(running: Running) -> tuple[str, str, dict[str, Any]]:
    """Wait for the banner, run the curl it prints, exactly as printed; return token, url and the JSON."""
    match = running.wait_for(BANNER_CURL)
    token, url = match[1], match[2]
    command = match[0]
    output = subprocess.run(
        [*shlex.split(command), "--silent", "--fail-with-body"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return token, url, json.loads(output)


def klique_cli(environment: dict[str, str], *arguments: str) -> str:
    """Run the `klique` command as a user would, and return what it printed."""
    return subprocess.run(
        [sys.executable, "-m", "klique.cli", *arguments],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def call(
    running: Running, method: str, path: str, token: str, host: str = "demo.localhost", **kwargs: Any
) -> Any:
    return httpx.request(
        method,
        f"http://127.0.0.1:{running.port}{path}",
        headers={"Host": f"{host}:{running.port}", "Authorization": f"Bearer {token}"},
        timeout=30,
        **kwargs,
    )


def portal_page(running: Running, host: str, username: str, password: str, page: str) -> httpx.Response:
    """Sign in on the portal's own form, as a browser would (CSRF cookie and field), then open `page`."""
    with httpx.Client(
        base_url=f"http://127.0.0.1:{running.port}", headers={"Host": f"{host}:{running.port}"}, timeout=30
    ) as browser:
        form = browser.get("/portal/sign-in/")
        assert form.status_code == 200, form.text
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
        assert csrf is not None, form.text
        signed_in = browser.post(
            "/portal/sign-in/",
            data={"csrfmiddlewaretoken": csrf[1], "username": username, "password": password},
        )
        assert (signed_in.status_code, signed_in.headers.get("location")) == (302, "/portal/"), signed_in.text
        return browser.get(page)


def stale_token(running: Running, token: str, database: str, *, days_ago: int) -> str:
    """Issue a token through the API, revoke it, and date the revocation `days_ago` back; returns its id."""
    issued = call(running, "POST", "/api/v1/tokens/", token, json={"name": f"revoked-{days_ago}"}).json()
    assert call(running, "DELETE", f"/api/v1/tokens/{issued['id']}/", token).status_code == 204
    with psycopg.connect(database, autocommit=True) as connection:
        connection.execute(
            "UPDATE demo.accounts_apitoken SET revoked_at = now() - make_interval(days => %s) WHERE id = %s",
            (days_ago, issued["id"]),
        )
    return str(issued["id"])


def token_rows(database: str, token_id: str) -> int:
    with psycopg.connect(database, autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*) FROM demo.accounts_apitoken WHERE id = %s", (token_id,)
        ).fetchone()
    assert row is not None
    return int(row[0])


async def first_event(port: int, token: str, create_project: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The welcome, and the first project event after create_project (the demo's tasks send their own
    events meanwhile: task.<state>, tasks.scheduled)."""
    async with websockets.connect(
        f"ws://demo.localhost:{port}/ws/v1/events/",
        host="127.0.0.1",
        port=port,
        additional_headers={"Authorization": f"Bearer {token}"},
    ) as stream:
        welcome = json.loads(await asyncio.wait_for(stream.recv(), 10))
        await asyncio.to_thread(create_project)
        async with asyncio.timeout(10):
            while not (event := json.loads(await stream.recv()))["kind"].startswith("project."):
                pass
        return welcome, event


def test_up_with_configured_services(fresh_database: str, redis_url: str, tmp_path: Path) -> None:
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url, KLIQUE_DEMO_CLOUD="1")
    running = start_up(environment, tmp_path / "data")
    second_web = None
    try:
        token, url, tenant = demo_curl(running)
        assert url == f"http://demo.localhost:{running.port}/api/v1/tenant/"
        assert tenant["slug"] == "demo"
        assert tenant["domains"] == ["demo.localhost"]

        # The banner's passwords open the demo's portal and the Platform Management Center.
        portal = running.printed(r"Portal: +(http://\S+)/portal/ +\(sign in: (\S+) / (\S+)\)")
        assert portal[1] == f"http://demo.localhost:{running.port}"
        page = portal_page(running, "demo.localhost", portal[2], portal[3], "/portal/dashboard/")
        assert page.status_code == 200
        assert "lab-h100" in page.text, page.text[:500]  # the demo's pool on the dashboard
        center = running.printed(
            r"Platform Management Center: +(http://\S+)/portal/ +\(sign in: (\S+) / (\S+)\)"
        )
        assert center[1] == f"http://localhost:{running.port}"
        page = portal_page(running, "localhost", center[2], center[3], "/portal/")
        assert page.status_code == 200
        assert '<tr data-tenant="demo">' in page.text, page.text[:500]  # the demo tenant in the list

        # Websockets through the real ASGI server: an event arrives when a project is made.
        welcome, event = asyncio.run(
            first_event(
                running.port,
                token,
                lambda: call(running, "POST", "/api/v1/projects/", token, json={"name": "e2e-project"}),
            )
        )
        assert welcome == {"type": "welcome", "tenant": "demo", "user": "alice"}
        assert (event["kind"], event["data"]["name"]) == ("project.saved", "e2e-project")

        # The demo's tasks were submitted; the worker's event-driven cycle placed them, the demo's agent ran
        # the two that fit its pool, and the third overflowed to the cloud pool: its autoscaler started an
        # instance (on moto's EC2, run on this host), whose own agent ran it.
        cli_env = {
            **environment,
            "KLIQUE_URL": f"http://demo.localhost:{running.port}",
            "KLIQUE_TOKEN": token,
        }
        for _ in range(120):
            listing = klique_cli(cli_env, "tasks")
            if listing.count(" completed ") == 3:
                break
            asyncio.run(asyncio.sleep(0.5))
        assert listing.count(" completed ") == 3, listing
        assert listing.count(" cloud-a100 ") == 1, listing
        finished = [line.split()[0] for line in listing.splitlines() if " lab-h100 " in line]
        task_id = call(running, "GET", f"/api/v1/tasks/?id_prefix={finished[0]}", token).json()["results"][0][
            "id"
        ]
        output = [
            line
            for chunk in call(running, "GET", f"/api/v1/tasks/{task_id}/logs/", token).json()
            for line in chunk["lines"]
        ]
        assert output[-1].startswith("epoch 3/3"), output
        assert output[0].startswith("GPUs: ")
        followed = klique_cli(cli_env, "logs", "-f", finished[0]).splitlines()
        assert followed[-2:] == ["epoch 3/3 loss=0.333", "-- task completed --"], followed
        saved = klique_cli(cli_env, "outputs", finished[0], "--download", str(tmp_path / "out"))
        assert "Saved 1 outputs" in saved
        assert (tmp_path / "out" / "metrics.json").read_text() == '{"loss": 0.333}'
        history = [
            event["to_state"]
            for event in call(running, "GET", f"/api/v1/tasks/{task_id}/history/", token).json()
        ]
        assert history == ["queued", "placed", "dispatching", "running", "completed"]
        in_cloud = next(line.split()[0] for line in listing.splitlines() if " cloud-a100 " in line)
        cloud_id = call(running, "GET", f"/api/v1/tasks/?id_prefix={in_cloud}", token).json()["results"][0][
            "id"
        ]
        cloud_history = call(running, "GET", f"/api/v1/tasks/{cloud_id}/history/", token).json()
        # Taken by the autoscaler, handed on to the instance's agent under a new lease, run there.
        assert [event["to_state"] for event in cloud_history] == [
            "queued", "placed", "dispatching", "dispatching", "running", "completed",
        ]  # fmt: skip
        assert "handed on to demo-cloud-a100-" in cloud_history[3]["message"]
        queues = klique_cli(cli_env, "queues")
        assert "Research: 4 GPUs" in queues

        # The demo's LLM gateway answers the official client, on the demo's own local model.
        gateway_curl = running.wait_for(r"(/v1/chat/completions)")
        assert gateway_curl[1] == "/v1/chat/completions"
        client = openai.OpenAI(
            api_key=token,
            base_url=f"http://127.0.0.1:{running.port}/v1",
            default_headers={"Host": f"demo.localhost:{running.port}"},
        )
        reply = client.chat.completions.create(
            model="demo-echo", messages=[{"role": "user", "content": "hello demo"}], max_tokens=3
        )
        assert reply.choices[0].message.content == "hello demo hello"
        usage = call(running, "GET", "/api/v1/gateway/usage/", token).json()["results"]
        assert (usage[0]["model"], usage[0]["tokens_out"]) == ("demo-echo", 3)
        started = time.monotonic()  # the README's curl sends no max_tokens: a brief answer, at once
        brief = client.chat.completions.create(
            model="demo-echo", messages=[{"role": "user", "content": "hello demo"}]
        )
        assert time.monotonic() - started < 5
        assert 0 < len((brief.choices[0].message.content or "").split()) <= 32

        # The Celery worker runs tenant tasks in the schema named in the message, sent directly and through
        # the fan-out to every tenant. Klique keeps no task results, so what each task did is read back
        # from the demo's schema: a token revoked over 30 days ago is purged, a fresh one is kept.
        celery = Celery(broker=redis_url)
        kept = stale_token(running, token, fresh_database, days_ago=0)
        for message in (
            ("accounts.token_purge_expired", "demo"),
            ("tenants.for_each_tenant", "accounts.token_purge_expired"),
        ):
            purged = stale_token(running, token, fresh_database, days_ago=31)
            celery.send_task(message[0], args=(message[1],))
            for _ in range(120):
                if not token_rows(fresh_database, purged):
                    break
                time.sleep(0.5)
            assert token_rows(fresh_database, purged) == 0, message
            assert token_rows(fresh_database, kept) == 1, message

        # Revocation reaches every process at once: a second web process refuses a token revoked in the first.
        second_port = free_port()
        second_web = subprocess.Popen(
            [sys.executable, "-m", "klique.cli", "web", "--port", str(second_port)],
            cwd=ROOT,
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        second = Running(process=second_web, port=second_port)  # type: ignore[arg-type]
        issued = call(running, "POST", "/api/v1/tokens/", token, json={"name": "roaming"}).json()
        for _ in range(100):
            try:
                if call(second, "GET", "/api/v1/me/", issued["token"]).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            asyncio.run(asyncio.sleep(0.2))
        assert call(second, "GET", "/api/v1/me/", issued["token"]).status_code == 200
        assert call(running, "DELETE", f"/api/v1/tokens/{issued['id']}/", token).status_code == 204
        refused = call(second, "GET", "/api/v1/me/", issued["token"])
        assert refused.status_code == 401
        assert "revoked" in refused.json()["detail"]
    finally:
        if second_web is not None:
            second_web.terminate()
            second_web.wait(timeout=30)
        exit_code = running.interrupt()
    assert exit_code == 0, "".join(running.lines[-30:])

    # A second run reuses what the first made.
    again = start_up(environment, tmp_path / "data")
    try:
        _, _, tenant_again = demo_curl(again)
        assert tenant_again["created_at"] == tenant["created_at"]
    finally:
        assert again.interrupt() == 0


def test_up_on_embedded_postgres_and_redis(tmp_path: Path) -> None:
    """No DATABASE_URL, no REDIS_URL: both come from Python packages into the data folder."""
    data_dir = tmp_path / "data"
    running = start_up(clean_environment(KLIQUE_DEMO_CLOUD="1"), data_dir)
    try:
        running.wait_for(r"Started embedded PostgreSQL and Redis")
        _, _, tenant = demo_curl(running)
        assert tenant["slug"] == "demo"
        ready = httpx.get(f"http://127.0.0.1:{running.port}/readyz", timeout=10).json()
        assert ready["status"] == "ready"
    finally:
        exit_code = running.interrupt()
    assert exit_code == 0, "".join(running.lines[-30:])
    assert (data_dir / "postgres" / "PG_VERSION").exists()

    again = start_up(clean_environment(KLIQUE_DEMO_CLOUD="1"), data_dir)
    try:
        _, _, tenant_again = demo_curl(again)
        assert tenant_again["created_at"] == tenant["created_at"]
    finally:
        assert again.interrupt() == 0
