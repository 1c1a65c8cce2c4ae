"""A Slurm cluster on a Kubernetes pool (protocol.clusters, protocol.pods, agents.kubernetes) against
kmock's API emulator: the controller's pod, its files and the Service its workers reach it by; a worker
task's pod as its node; the objects owned by the run and gone with it; a worker elsewhere refused."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.backend import Refused, free_port
from agents.kubernetes import Kubernetes
from agents.main import Agent
from protocol import clusters, pods
from tests.agents.kube import Cluster, Kubelet
from tests.agents.test_app_tunnel import app_assignment
from tests.agents.test_baremetal import backend as baremetal
from tests.agents.test_kubernetes import Recorder, assignment, backend, begin, refusal, until

pytestmark = pytest.mark.timeout(120)

IMAGE = "registry.example/klique-slurm:22.05"
CONTROLLER = "0f0e0d0c-0b0a-4999-8888-777766665555"
LEASE = "abcdef12-3456-4789-8abc-def012345678"
JOB = pods.job_name(CONTROLLER, LEASE)
NAME = clusters.cluster_name(JOB)
PLANE = "https://acme.klique.example"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster().start()
    yield running
    running.stop()


def controller_task(**cluster: Any) -> dict[str, Any]:
    port = free_port()
    task = assignment(CONTROLLER, gpus=0, lease_id=LEASE, task_token="kqt_0f0e_signed", plane_url=PLANE)
    task["spec"] = {
        "image": IMAGE,
        "command": [
            "sh",
            f"{clusters.SLURM_PATH}/start",
            "controller",
            "--",
            "ttyd",
            "-p",
            str(port),
            "bash",
        ],
        "environment": {"PORT": str(port)},
        "app": {
            "instance": "0a1b2c",
            "port": port,
            "health_path": "/",
            "startup_seconds": 300,
            "cluster": {"service": "slurm", "workers": 4, "worker_gpus": 2, **cluster},
        },
    }
    return task


def worker_task(task_id: str, at: str, **section: Any) -> dict[str, Any]:
    task = assignment(task_id, gpus=2, lease_id="77777777-3456-4789-8abc-def012345678")
    task["spec"] = {
        "image": IMAGE,
        "command": clusters.worker_command(at, clusters.slurm_controller(JOB)),
        clusters.WORKER_SECTION: {
            "controller": CONTROLLER,
            "lease": LEASE,
            "node": at,
            "secret": clusters.slurm_secret(JOB),
            "cpus": 8,
            **section,
        },
    }
    return task


def test_the_controller_is_the_apps_pod_with_the_clusters_files_and_a_service_for_its_workers(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = controller_task(partition="train")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        job = await asyncio.to_thread(kubelet.job, JOB)
        pods.validate_workload(job)
        spec = job["spec"]["template"]["spec"]
        assert spec["hostname"] == f"{NAME}-ctld"  # slurmctld runs only on its SlurmctldHost
        (main,) = spec["containers"]
        assert main["image"] == IMAGE
        assert "nvidia.com/gpu" not in str(main["resources"])  # the controller holds none: workers do
        mount = next(item for item in main["volumeMounts"] if item["mountPath"] == clusters.SLURM_PATH)
        volume = next(item for item in spec["volumes"] if item["name"] == mount["name"])
        assert volume["secret"] == {"secretName": f"{JOB}-slurm", "defaultMode": 0o500}

        files = await asyncio.to_thread(kubelet.secret, f"{JOB}-slurm")
        for made in (files, await asyncio.to_thread(kubelet.service, f"{NAME}-ctld")):
            kept = (
                "apiVersion",
                "kind",
                "type",
                "data",
                "stringData",
                "spec",
            )  # as made, not as the API adds
            rendered = {key: made[key] for key in kept if key in made}
            pods.validate_workload({**rendered, "metadata": {"name": made["metadata"]["name"]}})
        written = files["stringData"]
        assert f"NodeName={NAME}-w[0-3] State=CLOUD CPUs=4 Gres=gpu:2" in written["slurm.conf"].splitlines()
        assert "PartitionName=train" in written["slurm.conf"]
        assert written["token"] == "kqt_0f0e_signed"  # the controller run's task token, for its programs
        assert f'"{PLANE}/agents/v1/tasks/{CONTROLLER}/slurm/"' in written["resume"]
        assert f'"{PLANE}/agents/v1/tasks/{CONTROLLER}/slurm/"' in written["reconcile"]
        assert written["start"] == clusters.START
        key = base64.b64decode(files["data"]["munge.key"])
        assert len(key) == clusters.MUNGE_KEY_BYTES
        assert files["metadata"]["ownerReferences"][0]["name"] == JOB

        service = await asyncio.to_thread(kubelet.service, f"{NAME}-ctld")
        assert service["spec"]["ports"] == [{"name": "slurmctld", "protocol": "TCP", "port": 6817}]
        assert service["spec"]["selector"] == {
            "klique.io/agent": "agent-1", "klique.io/task": CONTROLLER, "klique.io/lease": LEASE
        }  # fmt: skip
        assert service["metadata"]["ownerReferences"][0]["name"] == JOB

        # Its pod takes in its relay and, on any port, its own cluster's workers; nothing else.
        policy = await asyncio.to_thread(kubelet.network_policy, pods.app_objects_name(JOB))
        rules = policy["spec"]["ingress"]
        assert rules[1] == {"from": [{"podSelector": {"matchLabels": {"klique.io/slurm-cluster": NAME}}}]}
        assert len(rules) == 2
        assert "from" not in rules[0]

        # The assignment again (a reconnect): the cluster keeps its munge key, or its workers could not join.
        await kube.start(task, recorder)
        assert (
            base64.b64decode((await asyncio.to_thread(kubelet.secret, f"{JOB}-slurm"))["data"]["munge.key"])
            == key
        )

        # Stopped: the files and the Service go with the run.
        await kube.stop(CONTROLLER, 5)
        await until(lambda: recorder.of("result"))
        await until(
            lambda: kubelet.gone("Secret", f"{JOB}-slurm") and kubelet.gone("Service", f"{NAME}-ctld")
        )
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_worker_task_is_a_pod_that_is_its_node_with_its_gpus(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    node = f"{NAME}-w2"
    task = worker_task("9a9b9c9d-0b0a-4999-8888-777766665555", node)

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name(task["task_id"], task["lease_id"])
        job = await asyncio.to_thread(kubelet.job, name)
        pods.validate_workload(job)
        template = job["spec"]["template"]
        spec = template["spec"]
        assert spec["hostname"] == node
        assert template["metadata"]["labels"]["klique.io/slurm-cluster"] == NAME
        (main,) = spec["containers"]
        assert main["command"] == ["sh", f"{clusters.SLURM_PATH}/start", "worker", node, f"{NAME}-ctld"]
        assert main["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert main["resources"]["requests"]["cpu"] == "8"
        mount = next(item for item in main["volumeMounts"] if item["mountPath"] == clusters.SLURM_PATH)
        volume = next(item for item in spec["volumes"] if item["name"] == mount["name"])
        assert volume["secret"]["secretName"] == f"{JOB}-slurm"  # the controller run's files
        # The controller's folder at the controller's path: a job runs where it was submitted from.
        shared = next(item for item in main["volumeMounts"] if item["mountPath"] == f"/klique/{CONTROLLER}")
        assert (shared["name"], shared["subPath"]) == ("klique-work", CONTROLLER)
        assert await asyncio.to_thread(kubelet.gone, "Service", f"{NAME}-ctld")  # a worker makes none
        await kube.stop_all(0)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"node": "worker; id"}, "slurm_worker.node"),
        ({"secret": "k-other-run-token"}, "slurm_worker.secret"),
        ({"cpus": 10_000}, "slurm_worker.cpus"),
        ({"controller": "../other-task"}, "slurm_worker.controller"),
    ],
)
def test_a_worker_section_klique_did_not_make_is_refused_for_good(
    cluster: Cluster, tmp_path: Path, section: dict[str, Any], words: str
) -> None:
    refused = refusal(
        backend(cluster, tmp_path),
        worker_task("9a9b9c9d-0b0a-4999-8888-777766665555", f"{NAME}-w0", **section),
    )
    assert words in str(refused)
    assert refused.permanent


def test_a_controller_without_the_planes_address_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    task = controller_task()
    task["plane_url"] = "https://acme.example/$(id)"
    refused = refusal(backend(cluster, tmp_path, relay_image=IMAGE), task)
    assert "cannot be written into a program" in str(refused)


def test_the_agent_tells_a_controller_where_the_plane_is_and_refuses_a_worker_off_kubernetes(
    tmp_path: Path,
) -> None:
    agent = Agent(url="wss://acme.klique.example/", token="t", backend=baremetal(tmp_path), agent_id="a")
    controller = app_assignment("t1", ["sh", "start"])
    controller["spec"]["app"] = {**controller["spec"]["app"], "cluster": {"service": "slurm"}}
    assert agent._with_plane(controller)["plane_url"] == "https://acme.klique.example"
    plain = app_assignment("t2", ["serve"])
    assert "plane_url" not in agent._with_plane(plain)
    worker = worker_task("9a9b9c9d-0b0a-4999-8888-777766665555", f"{NAME}-w0")
    with pytest.raises(
        Refused, match="A Slurm cluster's worker runs on a Kubernetes pool; a baremetal pool"
    ) as refused:
        agent._with_plane(worker)
    assert refused.value.permanent
    agent.backend = Kubernetes.__new__(Kubernetes)  # a Kubernetes agent takes it (its backend makes pods)
    assert agent._with_plane(worker) == worker
