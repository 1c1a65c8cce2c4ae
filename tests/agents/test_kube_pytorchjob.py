"""Multi-node tasks on a cluster with the Kubeflow training operator (and no JobSet): the agent finds the
PyTorchJob API by discovery and makes each multi-node task a PyTorchJob of a Master and Workers of the
task's pod, whose container is `pytorch` so the operator gives it the rendezvous variables, and follows it
through its pods (the operator's labels give each rank) and its own conditions. What every multi-node
workload does alike (failures, half a gang, preemption, deletion, adoption, Kueue) is in
test_kube_gangs.py. The operator is the tests' stand-in (tests/agents/kube.py); the client and the API
calls are the official ones against kmock's emulator."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import pods
from tests.agents.kube import NAMESPACE, Cluster, Kubelet
from tests.agents.test_kubernetes import Recorder, assignment, backend, begin, until

pytestmark = pytest.mark.timeout(120)

PYTORCHJOBS = rf"/apis/kubeflow.org/v1/namespaces/{NAMESPACE}/pytorchjobs"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster(pytorchjob=True).start()
    yield running
    running.stop()


def running_states(recorder: Recorder) -> int:
    return len([body for body in recorder.of("status") if body["state"] == "running"])


def test_a_multi_node_task_is_a_pytorchjob_that_runs_to_completion(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("pt", gpus=12, nodes=3)
    name = pods.job_name("pt", "lease-pt")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        assert len(cluster.requests("POST", PYTORCHJOBS)) == 1
        assert not cluster.requests("POST", rf"/apis/batch/v1/namespaces/{NAMESPACE}/jobs")
        assert not cluster.requests("POST", rf"/api/v1/namespaces/{NAMESPACE}/services")  # the operator's
        job = await asyncio.to_thread(kubelet.pytorchjob, name)
        assert job["metadata"]["labels"]["klique.io/task"] == "pt"
        assert job["spec"]["runPolicy"]["backoffLimit"] == 0  # the plane retries, not the operator
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
        for spec in replicas.values():
            assert spec["restartPolicy"] == "Never"
            (main,) = spec["template"]["spec"]["containers"]
            assert main["name"] == "pytorch"
            assert main["resources"]["limits"] == {"nvidia.com/gpu": "4"}
            env = {item["name"] for item in main["env"]}
            assert not env & {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}  # the operator's to set
            assert "KLIQUE_GPUS_PER_NODE" in env
            assert "HF_TOKEN" not in env
            assert "subdomain" not in spec["template"]["spec"]
        await until(lambda: (kubelet.secret(name)["metadata"].get("ownerReferences") or [{}])[0].get("kind"))
        owner = (await asyncio.to_thread(kubelet.secret, name))["metadata"]["ownerReferences"][0]
        assert (owner["apiVersion"], owner["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
        made = await asyncio.to_thread(kubelet.make_pytorchjob_pods, name)
        assert made == [f"{name}-master-0", f"{name}-worker-0", f"{name}-worker-1"]
        for pod in made[:2]:
            await asyncio.to_thread(kubelet.run, pod)
        await asyncio.sleep(0.3)
        assert running_states(recorder) == 0  # two of three: the gang waits
        await asyncio.to_thread(kubelet.run, made[2])
        await until(lambda: running_states(recorder) == 1)
        for rank, pod in enumerate(made):
            await asyncio.to_thread(kubelet.write, pod, f"rank {rank} up")
        await until(lambda: len(recorder.lines()) == 3)
        streams = {body["stream"]: body["lines"] for body in recorder.of("log")}
        assert streams == {f"rank-{rank}": [f"rank {rank} up"] for rank in range(3)}
        logs = cluster.requests("GET", rf"/api/v1/namespaces/{NAMESPACE}/pods/{name}-.*/log")
        assert {query["container"] for _, _, query in logs} == {"pytorch"}
        for pod in made:
            await asyncio.to_thread(kubelet.end, pod, 0)
        await asyncio.to_thread(kubelet.pytorchjob_ended, name, True)
        (result,) = await until(lambda: recorder.of("result"), timeout=20)
        assert result["exit_code"] == 0
        assert (result["cluster"]["kind"], result["cluster"]["job_id"]) == ("PyTorchJob", name)
        assert await until(lambda: kubelet.gone("Secret", name))
        assert not kubelet.gone("PyTorchJob", name)  # kept for `kubectl describe` until its TTL
        await kube.stop_all(0)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("jobset", "pytorchjob", "made"),
    [(True, True, "jobsets"), (False, True, "pytorchjobs"), (False, False, "jobs")],
)
def test_auto_prefers_jobset_then_the_training_operator_then_an_indexed_job(
    jobset: bool, pytorchjob: bool, made: str, tmp_path: Path
) -> None:
    cluster = Cluster(jobset=jobset, pytorchjob=pytorchjob).start()
    try:
        kube = backend(cluster, tmp_path)
        recorder = Recorder(kube.state)
        task = assignment("auto", gpus=2, nodes=2)

        async def scenario() -> None:
            begin(kube, task)
            await kube.start(task, recorder)
            await kube.stop_all(0)

        asyncio.run(scenario())
        posted = {
            plural: len(cluster.requests("POST", rf"/apis/{api}/namespaces/{NAMESPACE}/{plural}"))
            for api, plural in (
                ("jobset.x-k8s.io/v1alpha2", "jobsets"),
                ("kubeflow.org/v1", "pytorchjobs"),
                ("batch/v1", "jobs"),
            )
        }
        assert posted == {plural: int(plural == made) for plural in posted}
    finally:
        cluster.stop()
