"""Apps on an HPC pool, against the real single-node Slurm (tests/hpc/conftest.py): the app runs in a job
as its user's account, on a port its node picks, and the agent reaches it through the node's relay at the
node Slurm names, with the run's key; what the job writes of its address is checked, and an app that does
not come up is stopped with the reason."""

from __future__ import annotations

import asyncio
import json
import pwd
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.hpc import Batch
from agents.relay import NodeRelay
from protocol.apps import AppSpec
from tests.hpc.conftest import PlaneStandIn, Reports, assignment, job_trace, make_backend, until

pytestmark = pytest.mark.usefixtures("slurm", "accounts")

SERVER = (
    "import http.server, os, pwd\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        account = pwd.getpwuid(os.getuid()).pw_name\n"
    "        body = ('%s %s %s' % (account, os.environ['PORT'], self.path)).encode()\n"
    "        self.send_response(200)\n"
    "        self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers()\n"
    "        self.wfile.write(body)\n"
    "http.server.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), H).serve_forever()\n"
)


def server(jobs_dir: Path) -> str:
    """The app's program, where the accounts can read it."""
    path = jobs_dir / "serve.py"
    path.write_text(SERVER)
    path.chmod(0o644)
    return str(path)


def app_task(task: str, command: list[str], startup_seconds: int = 60) -> dict[str, Any]:
    app = {"instance": "0123abcd", "port": None, "health_path": "/", "startup_seconds": startup_seconds}
    return assignment(task, command, spec={"app": app})


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_an_app_runs_in_a_job_and_the_agent_reaches_it_through_the_nodes_relay(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path, scheduler: str
) -> None:
    backend, reports, task = make_backend(scheduler, jobs_dir, plane, tmp_path), Reports(), str(uuid.uuid4())
    handed = app_task(task, ["/usr/bin/python3", server(jobs_dir), "--port={port}"])
    folder = jobs_dir / task

    async def scenario() -> tuple[str, str, str]:
        await backend.start(handed, reports)
        app = AppSpec.parse(handed["spec"]["app"])
        upstream = await asyncio.wait_for(backend.app_upstream(task, app), 60)
        assert isinstance(upstream, NodeRelay), job_trace(plane, jobs_dir, task)
        try:
            async with httpx.AsyncClient(transport=upstream.transport(), base_url=upstream.local) as client:
                answer = await client.get("/lab?x=1")
        finally:
            await upstream.aclose()
        await backend.stop(task, 5)
        await until(lambda: reports.of(task, "result"), seen=lambda: job_trace(plane, jobs_dir, task))
        assert backend.poller is not None
        backend.poller.cancel()
        return upstream.host, upstream.describe(), answer.text

    host, described, text = asyncio.run(scenario())
    assert host == "localhost"  # the node as the cluster names it (Slurm's BatchHost, PBS's exec_host)
    account, port, path = text.split()
    assert (account, path) == ("kqalice", "/lab?x=1")
    written = json.loads((folder / "app-address").read_text())
    assert port == str(written["app"])
    assert described == f"port {port} of node localhost"
    key = folder / "app-key"
    assert key.stat().st_uid == pwd.getpwnam("kqalice").pw_uid
    assert key.stat().st_mode & 0o777 == 0o600
    assert (folder / "app-address").stat().st_uid == pwd.getpwnam("kqalice").pw_uid
    [result] = reports.of(task, "result")
    assert result["stopped"] is True
    assert backend.spec_of(task) == {}  # the run is over: nothing to open again


def test_a_restarted_agent_opens_the_way_to_its_running_app_again(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    task, reports = str(uuid.uuid4()), Reports()
    handed = app_task(task, ["/usr/bin/python3", server(jobs_dir)])
    first = make_backend("slurm", jobs_dir, plane, tmp_path)

    async def before() -> None:
        await first.start(handed, reports)
        await until(lambda: any(s["state"] == "running" for s in reports.of(task, "status")))
        assert first.poller is not None
        first.poller.cancel()

    asyncio.run(before())
    restarted = make_backend("slurm", jobs_dir, plane, tmp_path)

    async def after() -> str:
        assert restarted.adopt(reports) == [task]
        spec = restarted.spec_of(task)
        assert spec == {"app": handed["spec"]["app"]}  # from the agent's own state, not the job's folder
        upstream = await asyncio.wait_for(restarted.app_upstream(task, AppSpec.parse(spec["app"])), 60)
        assert upstream is not None
        try:
            async with httpx.AsyncClient(transport=upstream.transport(), base_url=upstream.local) as client:
                text = (await client.get("/again")).text
        finally:
            await upstream.aclose()
        await restarted.stop(task, 0)
        await until(lambda: reports.of(task, "result"))
        assert restarted.poller is not None
        restarted.poller.cancel()
        return text

    assert asyncio.run(after()).endswith(" /again")


def not_located(backend: Batch, reports: Reports, handed: dict[str, Any], seen: Callable[[], str]) -> Any:
    """Start an app whose job spoils its own address once it runs: the agent finds no way to it and
    stops the run; its result."""
    task = handed["task_id"]

    async def scenario() -> None:
        await backend.start(handed, reports)
        await until(lambda: any(s["state"] == "running" for s in reports.of(task, "status")))
        await asyncio.sleep(1.5)  # the job's command has spoilt what its reporter wrote
        found = await asyncio.wait_for(backend.app_upstream(task, AppSpec.parse(handed["spec"]["app"])), 60)
        assert found is None
        await until(lambda: reports.of(task, "result"), seen=seen)
        assert backend.poller is not None
        backend.poller.cancel()

    asyncio.run(scenario())
    [result] = reports.of(task, "result")
    return result


FORGERIES = {
    # The app rewrites its address: the agent fails the run rather than follow it.
    "ports of its choosing": ('{"relay": 22, "app": 6817}', "its ports are not whole numbers"),
    "another shape": ('{"relay": 40000, "app": 40001, "host": "10.0.0.1"}', 'it is not {"relay"'),
    "not JSON": ("relay=40000", "it is not JSON"),
}


@pytest.mark.parametrize("forged", sorted(FORGERIES))
def test_an_address_the_job_rewrites_wrong_fails_the_run_saying_why(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path, forged: str
) -> None:
    text, why = FORGERIES[forged]
    backend, reports, task = make_backend("slurm", jobs_dir, plane, tmp_path), Reports(), str(uuid.uuid4())
    script = f"printf '%s' '{text}' > app-address.new && mv app-address.new app-address && sleep 60"
    handed = app_task(task, ["bash", "-c", script])

    result = not_located(backend, reports, handed, lambda: job_trace(plane, jobs_dir, task))
    assert result["reason"].startswith(f"the app's address in its folder cannot be used: {why}")
    assert result["stopped"] is True


def test_an_address_that_is_a_link_is_not_followed_and_the_app_is_stopped_in_time(
    jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path
) -> None:
    """The job makes its address a link to a file it does not own (a valid address, as far as its text
    goes): the agent reads no file that is not the account's, and stops the app once its startup time
    has passed, with its output's last lines."""
    decoy = tmp_path / "decoy"
    decoy.write_text('{"relay": 40000, "app": 40001}')
    backend, reports, task = make_backend("slurm", jobs_dir, plane, tmp_path), Reports(), str(uuid.uuid4())
    script = f"echo loading; ln -sf {decoy} app-address; sleep 60"
    handed = app_task(task, ["bash", "-c", script], startup_seconds=3)

    result = not_located(backend, reports, handed, lambda: job_trace(plane, jobs_dir, task))
    assert (jobs_dir / task / "app-address").is_symlink()
    assert "its app's relay did not open within 3 s" in result["reason"], result
    assert result["reason"].endswith("its log ends: loading")


def test_an_app_asks_for_one_node(jobs_dir: Path, plane: PlaneStandIn, tmp_path: Path) -> None:
    from agents.backend import Refused

    backend, reports, task = make_backend("slurm", jobs_dir, plane, tmp_path), Reports(), str(uuid.uuid4())
    handed = {**app_task(task, ["true"]), "nodes": 2, "size_units": 2 * 840}

    async def scenario() -> None:
        await backend.start(handed, reports)

    with pytest.raises(Refused, match="An app runs on one node; this one asks for 2") as refused:
        asyncio.run(scenario())
    assert refused.value.permanent
