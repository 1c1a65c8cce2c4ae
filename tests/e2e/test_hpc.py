"""The whole HPC path: `klique up --demo`, a real `klique-agent --backend slurm` on a real single-node
Slurm, tasks submitted through the API and run by Slurm as the users' own Linux accounts."""

from __future__ import annotations

import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ROOT, clean_environment, start_up
from tests.e2e.test_agent_crash import Demo
from tests.e2e.test_up import BANNER_CURL

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("accounts")]

TRAIN = (
    "echo gpus=$CUDA_VISIBLE_DEVICES; id -un; "
    "for i in $(seq 1 16); do echo step $i; sleep 1; done; "  # outlives a heartbeat (10 s)
    "echo '{\"loss\": 0.25}' > metrics.json; "
    'echo \'{"loss": 0.25, "step": 16}\' >> "$KLIQUE_METRICS_FILE"'
)


def provision_slurm_pool(demo: Demo) -> str:
    """A Slurm pool "hpc" of 4 GPUs behind compute resource "Research: HPC"; its agent token."""
    return demo.pool_token(
        {"name": "hpc", "environment": "slurm", "capacity_gpus": 4},
        {"name": "two-gpu-hpc", "gpus": "2", "pools": [{"pool": "hpc"}]},
        {
            "profile": "two-gpu-hpc",
            "name": "Research: HPC",
            "batch": {"slurm": {"defaults": {"partition": "debug", "time_limit_minutes": 10}}},
        },
    )


def slurm_agent(demo: Demo, port: int, jobs_dir: Path, tmp_path: Path) -> list[str]:
    """The command line of a Slurm agent for the pool of provision_slurm_pool, alice mapped to kqalice."""
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[agent.slurm]\njobs_dir = "{jobs_dir}"\nnode_python = "/usr/bin/python3"\npoll_seconds = 0.5\n'
        '[agent.slurm.user_map]\nalice = "kqalice"\n'
    )
    token_file = tmp_path / "agent.token"
    token_file.write_text(provision_slurm_pool(demo))
    token_file.chmod(0o600)
    return [
        sys.executable, "-m", "agents.main", "--url", f"http://demo.localhost:{port}",
        "--token-file", str(token_file), "--backend", "slurm", "--config", str(config),
        "--agent-id", "login-1", "--work-dir", str(tmp_path / "agent"),
    ]  # fmt: skip


def slurm_job_of(demo: Demo, task_id: str, timeout: float = 30) -> str:
    """The Slurm job of a task, as the agent's heartbeat last told the pool's queue."""
    pool = next(pool for pool in demo.call("GET", "/api/v1/pools/")["results"] if pool["name"] == "hpc")
    deadline = time.monotonic() + timeout
    while True:
        seen = demo.call("GET", f"/api/v1/pools/{pool['id']}/queue/")["agents"]
        jobs = [job["job_id"] for agent in seen for job in agent["jobs"] if job["task_id"] == task_id]
        if jobs:
            return str(jobs[0])
        assert time.monotonic() < deadline, seen
        time.sleep(0.5)


def stop_agent_and_plane(agent: subprocess.Popen[bytes] | None, running: Any, tmp_path: Path) -> None:
    """The end of a test: the agent and `klique up` stopped, and no traceback in the agent's log."""
    if agent is not None and agent.poll() is None:
        agent.terminate()
        agent.wait(timeout=30)
    assert running.interrupt() == 0
    agent_log = (tmp_path / "agent.log").read_text() if (tmp_path / "agent.log").exists() else ""
    assert "Traceback" not in agent_log, agent_log


def cancel_jobs_of(environment: dict[str, str], task_id: str) -> None:
    """Cancel the Slurm jobs of a task, by their name (klique-<first 8 of its id>-...)."""
    listed = ["squeue", "--noheader", "--format=%i %j"]
    shown = subprocess.run(listed, env=environment, capture_output=True, text=True, check=False).stdout
    for line in shown.splitlines():
        job, _, name = line.strip().partition(" ")
        if name.startswith(f"klique-{task_id[:8]}"):
            subprocess.run(["scancel", job], env=environment, check=False)


def wait_for_state(demo: Demo, task_id: str, states: set[str], timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        task: dict[str, Any] = demo.call("GET", f"/api/v1/tasks/{task_id}/")
        if task["state"] in states or time.monotonic() > deadline:
            return task
        time.sleep(0.3)


def slurm_job(environment: dict[str, str], account: str, *options: str) -> str:
    """A job of someone else's, submitted to Slurm directly."""
    argv = ["runuser", "-u", account, "--", "sbatch", "--parsable", "--output=/dev/null", *options]
    return subprocess.run(argv, env=environment, capture_output=True, text=True, check=True).stdout.strip()


def wait_for_slurm(environment: dict[str, str], job: str, state: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        argv = ["sacct", "--noheader", "--parsable2", f"--jobs={job}", "--format=JobIDRaw,State"]
        rows = subprocess.run(argv, env=environment, capture_output=True, text=True, check=False).stdout
        seen = next((line.split("|")[1] for line in rows.splitlines() if line.split("|")[0] == job), "")
        if seen.startswith(state):
            return
        time.sleep(0.5)
    raise AssertionError(f"Slurm job {job} is {seen or 'unknown'}, not {state}")


def wait_for_reason(demo: Demo, task_id: str, reason: str, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        why: dict[str, Any] = demo.call("GET", f"/api/v1/tasks/{task_id}/why/")
        if why["reason"].endswith(reason) or time.monotonic() > deadline:
            return why
        time.sleep(0.5)


def test_tasks_run_in_slurm_as_their_users_and_survive_an_agent_restart(
    fresh_database: str, redis_url: str, slurm: Path, jobs_dir: Path, tmp_path: Path
) -> None:
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url, SLURM_CONF=str(slurm))
    running = start_up(environment, tmp_path / "data")
    agent = None
    try:
        admin_token = running.wait_for(BANNER_CURL)[1]
        demo = Demo(running.port, admin_token)
        argv = slurm_agent(demo, running.port, jobs_dir, tmp_path)
        log = (tmp_path / "agent.log").open("w")
        agent = subprocess.Popen(argv, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
        task = demo.call(
            "POST",
            "/api/v1/tasks/",
            json={
                "compute_resource": "Research: HPC",
                "name": "resnet",
                "spec": {"command": ["bash", "-c", TRAIN], "outputs": ["metrics.json"]},
            },
        )
        wait_for_state(demo, task["id"], {"running"})
        pool = next(pool for pool in demo.call("GET", "/api/v1/pools/")["results"] if pool["name"] == "hpc")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the cluster's queue, as the agent's heartbeat last told it
            seen = demo.call("GET", f"/api/v1/pools/{pool['id']}/queue/")["agents"]
            if seen and any(job["task_id"] == task["id"] for job in seen[0]["jobs"]):
                break
            time.sleep(0.5)
        [login] = seen
        [job] = [job for job in login["jobs"] if job["task_id"] == task["id"]]
        assert (job["state"], job["cluster_state"]) == ("running", "RUNNING")
        assert demo.logged(task["id"])[-1] != "step 16"  # still running when its agent is killed

        agent.send_signal(signal.SIGKILL)  # the job goes on in Slurm without its agent
        agent.wait(timeout=10)
        time.sleep(1)
        agent = subprocess.Popen(argv, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)

        final = wait_for_state(demo, task["id"], {"completed", "failed"})
        assert (final["state"], final["attempts"], final["exit_code"]) == ("completed", 1, 0), final
        lines = demo.logged(task["id"])
        assert lines[0].startswith("gpus=")
        assert len(lines[0].removeprefix("gpus=").split(",")) == 2, lines
        assert lines[1:] == ["kqalice", *(f"step {i}" for i in range(1, 17))]  # each line once
        metrics = demo.call("GET", f"/api/v1/tasks/{task['id']}/metrics/")
        assert [m["values"] for m in metrics if "gpus" not in m["values"]] == [{"loss": 0.25, "step": 16}]
        assert {m["source"] for m in metrics} == {"node-0"}
        outputs = demo.call("GET", f"/api/v1/tasks/{task['id']}/outputs/")
        assert [output["name"] for output in outputs] == ["metrics.json"]
        assert (jobs_dir / task["id"] / "output.log").stat().st_uid == pwd.getpwnam("kqalice").pw_uid
        history = [event["to_state"] for event in demo.call("GET", f"/api/v1/tasks/{task['id']}/history/")]
        assert history == ["queued", "placed", "dispatching", "running", "completed"]  # it ran once

        # Someone else's job holds the cluster's GPUs: Klique's next task waits inside Slurm with Slurm's
        # reason; cancelling it through Klique cancels the Slurm job.
        blocker = slurm_job(environment, "kqbob", "--gpus-per-node=4", "--wrap=sleep 300")
        try:
            wait_for_slurm(environment, blocker, "RUNNING")
            waiting = demo.call(
                "POST",
                "/api/v1/tasks/",
                json={"compute_resource": "Research: HPC", "spec": {"command": ["true"]}},
            )
            why = wait_for_reason(demo, waiting["id"], "Resources")
            assert why["state"] == "dispatching"
            job = why["reason"].split(" as job ")[1].split(":")[0]
            assert why["reason"] == f"Waiting in slurm as job {job}: Resources"
            demo.call("POST", f"/api/v1/tasks/{waiting['id']}/cancel/")
            assert wait_for_state(demo, waiting["id"], {"aborted"})["state"] == "aborted"
            wait_for_slurm(environment, job, "CANCELLED")
        finally:
            subprocess.run(["scancel", blocker], env=environment, check=False)

        # A user with no Linux account on the cluster: the task fails, saying why and what to do.
        bot = demo.call("POST", "/api/v1/service-accounts/", json={"name": "ci-bot", "role": "member"})
        research = next(g for g in demo.call("GET", "/api/v1/groups/")["results"] if g["name"] == "research")
        demo.call(
            "PATCH", f"/api/v1/groups/{research['id']}/", json={"members": [*research["members"], bot["id"]]}
        )
        bot_token = demo.call("POST", f"/api/v1/service-accounts/{bot['id']}/tokens/", json={"name": "ci"})[
            "token"
        ]
        as_bot = Demo(running.port, bot_token)
        refused = as_bot.call(
            "POST",
            "/api/v1/tasks/",
            json={"compute_resource": "Research: HPC", "spec": {"command": ["true"]}},
        )
        ended = wait_for_state(demo, refused["id"], {"failed"})
        assert ended["state"] == "failed", ended
        assert "has no Linux account on this cluster" in ended["reason"]
        assert "[agent.slurm.user_map]" in ended["reason"]
    finally:
        stop_agent_and_plane(agent, running, tmp_path)


SERVE = """
import http.server, os, pwd
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def answer(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path.startswith("/big"):
            self.answer(bytes(range(256)) * 20000)
        elif self.path == "/environment":
            self.answer(" ".join(sorted(os.environ)).encode())
        else:
            account = pwd.getpwuid(os.getuid()).pw_name
            self.answer(f"hello from {account} on port {os.environ['PORT']} at {self.path}".encode())
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.answer(f"{len(body)} bytes, {sum(body) % 1000}".encode())
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
"""


def test_an_app_on_a_slurm_pool_is_served_through_its_route_and_stopped_with_its_job(
    fresh_database: str, redis_url: str, slurm: Path, jobs_dir: Path, tmp_path: Path
) -> None:
    """An app launched on the HPC pool runs in a Slurm job as its user's account, on a port its node
    picked; the plane serves it at its route through the agent's tunnel and the node's relay, only to
    whom it is shared with; stopping it cancels the job."""
    from tests.e2e.test_apps import Route, wait_state

    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url, SLURM_CONF=str(slurm))
    program = jobs_dir / "serve.py"
    program.write_text(SERVE)
    program.chmod(0o644)
    running = start_up(environment, tmp_path / "data")
    agent, launched = None, {}
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        argv = slurm_agent(demo, running.port, jobs_dir, tmp_path)
        log = (tmp_path / "agent.log").open("w")
        agent = subprocess.Popen(argv, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
        template = {
            "name": "hello-hpc", "version": "1", "command": ["/usr/bin/python3", str(program)],
            "health": {"path": "/", "startup_seconds": 60}, "gpus": "2",
        }  # fmt: skip
        demo.call("POST", "/api/v1/catalogue/", json=template)
        launched = demo.call(
            "POST", "/api/v1/apps/", json={"entry": "hello-hpc", "compute_resource": "Research: HPC"}
        )
        app = wait_state(demo, launched["id"], "ready", timeout=120)
        route = Route(running.port, app["url"], demo.token)

        hello = route.get("/lab?x=1")
        assert hello.status_code == 200, hello.text
        assert hello.text.startswith("hello from kqalice on port "), hello.text  # the user's own account
        assert hello.text.endswith(" at /lab?x=1")
        body = bytes(range(256)) * 4096 * 2  # 2 MiB up, 5 MB down, through the tunnel and the relay
        assert route.request("POST", "/upload", content=body).text == f"{len(body)} bytes, {sum(body) % 1000}"
        big = route.get("/big")
        assert big.content == bytes(range(256)) * 20000

        stranger = demo.call("POST", "/api/v1/service-accounts/", json={"name": "stranger"})
        made = demo.call("POST", f"/api/v1/service-accounts/{stranger['id']}/tokens/", json={"name": "t"})
        assert Route(running.port, app["url"], made["token"]).get("/").status_code == 404

        job = slurm_job_of(demo, app["task_id"])
        demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
        wait_state(demo, app["id"], "stopped", timeout=60)
        wait_for_slurm(environment, job, "CANCELLED")
        assert route.get("/").status_code == 409
    finally:
        if launched:  # a failure above leaves no app running in Slurm for the next test
            cancel_jobs_of(environment, demo.call("GET", f"/api/v1/apps/{launched['id']}/")["task_id"])
        stop_agent_and_plane(agent, running, tmp_path)
