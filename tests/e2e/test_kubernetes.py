"""The whole Kubernetes path: `klique up --demo`, a real `klique-agent --backend kubernetes` against kmock's
API emulator with a one-node cluster beside it (tests/e2e/kubelet.py: its commands run as processes of
this host), tasks of each size submitted through the API, their logs and outputs home; the scheduler's
reason in `klique why`; the agent killed with SIGKILL while a Job runs and started again."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agents.kube import Cluster, Kubelet
from tests.e2e.conftest import ROOT, Running, clean_environment, start_up
from tests.e2e.kubelet import LocalNode
from tests.e2e.test_agent_crash import Demo
from tests.e2e.test_hpc import SERVE, wait_for_reason, wait_for_state
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

STEPS = (
    "import os, sys, time\n"
    "rank = os.environ.get('RANK', '0')\n"
    "for step in range(int(sys.argv[1])):\n"
    "    print(f'rank {rank} step {step}', flush=True)\n"
    "    time.sleep(float(sys.argv[2]))\n"
    "open('metrics.json', 'w').write('{\"loss\": 0.5}')\n"
    "print('gpus', os.environ.get('KLIQUE_GPU_MEMORY_FRACTION', 'whole'), flush=True)\n"
)
SIZES: dict[str, dict[str, Any]] = {  # compute resource -> profile
    "K8s: 2 GPUs": {"name": "k8s-two", "gpus": "2"},
    "K8s: half a GPU": {"name": "k8s-half", "sharing": "fraction", "min_gpus": "0.5", "max_gpus": "0.5"},
    "K8s: MIG slice": {"name": "k8s-mig", "sharing": "mig", "mig_profile": "1g.10gb"},
    "K8s: 2 x 4 GPUs": {"name": "k8s-multi", "nodes": 2, "gpus_per_node": 4},
    "K8s: 16 GPUs": {"name": "k8s-sixteen", "gpus": "16"},
}


def provision(demo: Demo) -> str:
    """A Kubernetes pool "k8s" behind one compute resource per size; its agent token."""
    document = demo.call("GET", "/api/v1/configuration/draft/")["document"]
    document["pools"].append(
        {
            "name": "k8s",
            "environment": "kubernetes",
            "capacity_gpus": 16,
            "sharing": ["whole", "fraction", "mig_static"],
        }
    )
    policy = document["policies"][0]
    policy["limit_gpus"] = "32"
    for resource, profile in SIZES.items():
        document["profiles"].append({**profile, "pools": [{"pool": "k8s"}]})
        policy["compute_resources"].append({"profile": profile["name"], "name": resource})
    demo.call("PUT", "/api/v1/configuration/draft/", json={"document": document})
    demo.call("POST", "/api/v1/configuration/draft/provision/")
    pool = next(row for row in demo.call("GET", "/api/v1/pools/")["results"] if row["name"] == "k8s")
    token: str = demo.call("POST", f"/api/v1/pools/{pool['id']}/agent-tokens/", json={"name": "k8s"})["token"]
    return token


class Plane:
    def __init__(self, tmp_path: Path, cluster: Cluster) -> None:
        self.tmp_path, self.cluster = tmp_path, cluster
        self.running: Running | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.volume = tmp_path / "volume"
        self.config = tmp_path / "agent.toml"
        self.config.write_text(
            f'[agent.kubernetes]\nnamespace = "ml"\napi_url = "{cluster.url}"\n'
            f'outputs_dir = "{self.volume}"\n'
            'work_volume = { persistentVolumeClaim = { claimName = "klique-work" } }\n'
            "poll_seconds = 0.2\ngang_seconds = 4\n"
            'relay_image = "ghcr.io/klique/klique:test"\n'
        )

    def token_file(self, demo: Demo) -> Path:
        """The pool provisioned (provision) and its agent token in a file of mode 600."""
        token_file = self.tmp_path / "agent.token"
        token_file.write_text(provision(demo))
        token_file.chmod(0o600)
        return token_file

    def stop_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            self.agent.wait(15)

    def start_agent(self, demo: Demo, token_file: Path, *extra: str, log: str = "agent.log") -> None:
        self.agent = self.spawn_agent(demo, token_file, *extra, log=log)

    def spawn_agent(
        self, demo: Demo, token_file: Path, *extra: str, log: str = "agent.log"
    ) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable,
            "-m",
            "agents.main",
            "--url",
            f"http://demo.localhost:{demo.port}",
            "--token-file",
            str(token_file),
            "--backend",
            "kubernetes",
            "--config",
            str(self.config),
            "--agent-id",
            "k8s-1",
            "--work-dir",
            str(self.tmp_path / "agent"),
            *extra,
        ]
        output = (self.tmp_path / log).open("ab")
        return subprocess.Popen(argv, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster().start()
    yield running
    running.stop()


def cluster_state(cluster: Cluster) -> list[tuple[Any, ...]]:
    """Each pod's phase and conditions, for a failure's message."""
    kubelet = Kubelet(cluster)
    found = json.loads(kubelet.core.list_namespaced_pod("ml", _preload_content=False).data)["items"]
    return [
        (
            pod["metadata"]["name"],
            (pod.get("status") or {}).get("phase"),
            (pod.get("status") or {}).get("conditions"),
        )
        for pod in found
    ]


def agent_log(tmp_path: Path) -> str:
    lines = (tmp_path / "agent.log").read_text().splitlines()
    return "\n".join(line for line in lines if "aiohttp" not in line)[-4000:]


def submit(demo: Demo, resource: str, steps: int, pause: float, **extra: Any) -> dict[str, Any]:
    spec = {
        "command": [sys.executable, "-c", STEPS, str(steps), str(pause)],
        "outputs": ["metrics.json"],
        **extra,
    }
    body: dict[str, Any] = {"compute_resource": resource, "spec": spec}
    if resource == "K8s: half a GPU":
        body["gpus"] = "0.5"  # a fractional profile takes the size from the task
    task: dict[str, Any] = demo.call("POST", "/api/v1/tasks/", json=body)
    return task


def test_tasks_of_each_size_run_on_kubernetes_and_survive_an_agent_killed_mid_job(
    fresh_database: str, redis_url: str, tmp_path: Path, cluster: Cluster
) -> None:
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    plane = Plane(tmp_path, cluster)
    node = LocalNode(cluster, plane.volume).start()
    secret = f"klq-k8s-{secrets.token_hex(12)}"
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        token_file = plane.token_file(demo)
        demo.call(
            "POST",
            "/api/v1/secrets/",
            json={
                "scope": "tenant",
                "name": "HF_TOKEN",
                "value": secret,
                "audience": {"groups": ["research"]},
            },
        )
        plane.start_agent(demo, token_file)

        tasks = {resource: submit(demo, resource, 3, 0.1) for resource in SIZES if resource != "K8s: 16 GPUs"}
        for resource, task in tasks.items():
            done = wait_for_state(demo, task["id"], {"completed", "failed"})
            assert done["state"] == "completed", (
                resource,
                done["reason"],
                cluster_state(cluster),
                node.errors,
            )
        multi = demo.logged(tasks["K8s: 2 x 4 GPUs"]["id"])
        assert sorted(line for line in multi if "step" in line) == sorted(
            f"rank {rank} step {step}" for rank in (0, 1) for step in range(3)
        )
        assert "gpus 0.5000" in demo.logged(tasks["K8s: half a GPU"]["id"])
        outputs = demo.call("GET", f"/api/v1/tasks/{tasks['K8s: 2 GPUs']['id']}/outputs/")
        assert [item["name"] for item in outputs] == ["metrics.json"]

        # More GPUs than the node has: it waits with the scheduler's words, in `klique why`.
        big = submit(demo, "K8s: 16 GPUs", 1, 0.1)
        why = wait_for_reason(
            demo, big["id"], "1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes are available."
        )
        assert "Unschedulable: 0/1 nodes are available" in why["reason"], why
        demo.call("POST", f"/api/v1/tasks/{big['id']}/cancel/")

        # The agent is killed with SIGKILL while a Job runs, and started again.
        long = submit(demo, "K8s: 2 GPUs", 20, 0.25, secrets=["HF_TOKEN"])
        demo.wait_for_lines(long["id"], 4)
        assert plane.agent is not None
        plane.agent.send_signal(signal.SIGKILL)
        plane.agent.wait(10)
        time.sleep(1.5)  # the Job runs on without its agent
        plane.start_agent(demo, token_file)
        done = wait_for_state(demo, long["id"], {"completed", "failed"})
        assert done["state"] == "completed", (done["reason"], cluster_state(cluster), agent_log(tmp_path))
        lines = [line for line in demo.logged(long["id"]) if "step" in line]
        assert lines == [f"rank 0 step {step}" for step in range(20)]  # none lost, none twice
        made = [name for name in node.created_jobs if long["id"][:8] in name]
        assert len(made) == 1  # adopted, not created again

        # The secret reached the task's Secret only: not the pod spec, nor any log.
        jobs = Kubelet(cluster).jobs()
        assert any(long["id"] in str(job) for job in jobs)
        assert secret not in str(jobs)
        assert secret not in (tmp_path / "agent.log").read_text()
    finally:
        node.stop()
        plane.stop_agent()
        assert running.interrupt() == 0
    assert secret not in running.everything()  # web, worker, beat and the demo agent print there


def test_an_app_on_a_kubernetes_pool_is_served_through_its_relay_and_stopped_with_its_pod(
    fresh_database: str, redis_url: str, tmp_path: Path, cluster: Cluster
) -> None:
    """An app launched on the Kubernetes pool runs in a pod with its relay as a sidecar; the plane serves it
    at its route through the agent's tunnel and the relay (only to whom it is shared with), again after the
    agent was killed and started; stopping it deletes the pod, its relay and its key's Secret."""
    from tests.e2e.test_apps import Route, wait_state

    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    plane = Plane(tmp_path, cluster)
    node = LocalNode(cluster, plane.volume).start()
    program = tmp_path / "serve.py"
    program.write_text(SERVE)
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        token_file = plane.token_file(demo)
        plane.start_agent(demo, token_file)
        template = {
            "name": "hello-k8s", "version": "1", "command": [sys.executable, str(program)],
            "health": {"path": "/", "startup_seconds": 60}, "gpus": "2",
        }  # fmt: skip
        demo.call("POST", "/api/v1/catalogue/", json=template)
        launched = demo.call(
            "POST", "/api/v1/apps/", json={"entry": "hello-k8s", "compute_resource": "K8s: 2 GPUs"}
        )
        app = wait_state(demo, launched["id"], "ready", timeout=120)
        route = Route(running.port, app["url"], demo.token)
        hello = route.get("/lab?x=1")
        assert hello.status_code == 200, hello.text
        assert hello.text.startswith("hello from "), hello.text
        assert hello.text.endswith(" at /lab?x=1")
        body = bytes(range(256)) * 4096 * 2  # 2 MiB up, 5 MB down, through the tunnel and the relay
        assert route.request("POST", "/upload", content=body).text == f"{len(body)} bytes, {sum(body) % 1000}"
        assert route.get("/big").content == bytes(range(256)) * 20000
        seen = route.get("/environment").text.split()
        assert "PORT" in seen
        assert "KLIQUE_APP_KEY" not in seen  # the relay's key is the sidecar's alone

        (job,) = [job for job in Kubelet(cluster).jobs() if app["task_id"] in str(job)]
        name = job["metadata"]["name"]
        (run,) = node.running.values()
        (relay,) = run.sidecars
        assert relay.poll() is None

        stranger = demo.call("POST", "/api/v1/service-accounts/", json={"name": "stranger"})
        made = demo.call("POST", f"/api/v1/service-accounts/{stranger['id']}/tokens/", json={"name": "t"})
        assert Route(running.port, app["url"], made["token"]).get("/").status_code == 404

        # The agent is killed and started again: it finds the app's relay from its state.
        assert plane.agent is not None
        plane.agent.send_signal(signal.SIGKILL)
        plane.agent.wait(10)
        plane.start_agent(demo, token_file)
        deadline = time.monotonic() + 60
        while (again := route.get("/again")).status_code != 200:
            assert time.monotonic() < deadline, (again.status_code, again.text, agent_log(tmp_path))
            time.sleep(0.5)
        assert again.text.endswith(" at /again")

        demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
        wait_state(demo, app["id"], "stopped", timeout=60)
        relay.wait(30)  # the sidecar stopped with its pod
        kubelet = Kubelet(cluster)
        deadline = time.monotonic() + 30
        made = (("Secret", f"{name}-app"), ("Secret", name), ("NetworkPolicy", f"{name}-app"))
        while not all(kubelet.gone(kind, item) for kind, item in made):
            assert time.monotonic() < deadline, agent_log(tmp_path)
            time.sleep(0.3)
        assert not kubelet.pods_of(name)
        assert route.get("/").status_code == 409
    finally:
        node.stop()
        plane.stop_agent()
        assert running.interrupt() == 0


def opened(process: subprocess.Popen[bytes], name: str) -> bool:
    """Whether the process holds a file of that name open (its descriptors, as /proc shows them)."""
    folder = Path(f"/proc/{process.pid}/fd")
    held = []
    for descriptor in folder.iterdir():
        with contextlib.suppress(OSError):
            held.append(os.readlink(descriptor))
    return any(Path(target).name == name for target in held)


def holder(cluster: Cluster) -> str:
    assert cluster.emulator is not None
    emulator = cluster.emulator
    lease = cluster.call(lambda: dict(emulator.leases.get("klique-agent-k8s-1") or {}))
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def test_a_standby_on_shared_state_takes_over_a_leader_killed_mid_job(
    fresh_database: str, redis_url: str, tmp_path: Path, cluster: Cluster
) -> None:
    """Two agents on one work folder (a ReadWriteMany claim in the chart), leader election on: the standby
    does not open the state while the leader holds the Lease; the leader is killed with SIGKILL while a Job
    runs; the standby takes the Lease once it has run out, opens the state, adopts the Job and brings every
    line home once."""
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    plane = Plane(tmp_path, cluster)
    with plane.config.open("a") as config:
        config.write("leader_election = true\nlease_seconds = 3\n")
    node = LocalNode(cluster, plane.volume).start()
    standby: subprocess.Popen[bytes] | None = None
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        token_file = plane.token_file(demo)
        plane.start_agent(demo, token_file, "--shared-state", log="leader.log")
        assert plane.agent is not None
        leader = plane.agent
        deadline = time.monotonic() + 30
        while not holder(cluster).endswith(f"-{leader.pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert holder(cluster).endswith(f"-{leader.pid}"), holder(cluster)
        standby = plane.spawn_agent(demo, token_file, "--shared-state", log="standby.log")

        task = submit(demo, "K8s: 2 GPUs", 24, 0.25)
        demo.wait_for_lines(task["id"], 4)
        assert opened(leader, "agent.sqlite")
        assert not opened(standby, "agent.sqlite")  # a standby has not touched the leader's state
        assert standby.poll() is None
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        done = wait_for_state(demo, task["id"], {"completed", "failed"})
        standby_log = (tmp_path / "standby.log").read_text()
        assert done["state"] == "completed", (done["reason"], cluster_state(cluster), standby_log[-4000:])
        assert holder(cluster).endswith(f"-{standby.pid}")
        assert opened(standby, "agent.sqlite")
        lines = [line for line in demo.logged(task["id"]) if "step" in line]
        assert lines == [f"rank 0 step {step}" for step in range(24)]  # none lost, none twice
        made = [name for name in node.created_jobs if task["id"][:8] in name]
        assert len(made) == 1  # adopted by the standby, not created again
        outputs = demo.call("GET", f"/api/v1/tasks/{task['id']}/outputs/")
        assert [item["name"] for item in outputs] == ["metrics.json"]
    finally:
        node.stop()
        for process in (plane.agent, standby):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(15)
        assert running.interrupt() == 0


def test_a_multi_node_task_runs_as_a_jobset_where_the_cluster_has_jobset(
    fresh_database: str, redis_url: str, tmp_path: Path
) -> None:
    """The same 2 x 4 task through the API, on a cluster that serves JobSet: the agent finds it by discovery
    and makes a JobSet, whose controller (the node's stand-in) makes the Indexed Job; both ranks run, their
    lines and the output come home, and no Service or Job of Klique's own is made."""
    cluster = Cluster(jobset=True).start()
    environment = clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url)
    running = start_up(environment, tmp_path / "data")
    plane = Plane(tmp_path, cluster)
    node = LocalNode(cluster, plane.volume).start()
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        token_file = plane.token_file(demo)
        plane.start_agent(demo, token_file)
        task = submit(demo, "K8s: 2 x 4 GPUs", 3, 0.1)
        done = wait_for_state(demo, task["id"], {"completed", "failed"})
        assert done["state"] == "completed", (done["reason"], cluster_state(cluster), node.errors)
        lines = demo.logged(task["id"])
        assert sorted(line for line in lines if "step" in line) == sorted(
            f"rank {rank} step {step}" for rank in (0, 1) for step in range(3)
        )
        (jobset,) = [name for name in node.created_jobsets if task["id"][:8] in name]
        assert len(cluster.requests("POST", r"/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets")) == 1
        jobs = Kubelet(cluster).jobs()  # only the one the JobSet controller made
        assert [job["metadata"]["name"] for job in jobs] == [f"{jobset}-node-0"]
        assert jobs[0]["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] == jobset
        assert len(cluster.requests("POST", r"/api/v1/namespaces/ml/services")) == 0
        outputs = demo.call("GET", f"/api/v1/tasks/{task['id']}/outputs/")
        assert [item["name"] for item in outputs] == ["metrics.json"]
    finally:
        node.stop()
        plane.stop_agent()
        assert running.interrupt() == 0
        cluster.stop()
