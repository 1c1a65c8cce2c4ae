"""Multi-node tasks on a cluster with the Kubeflow training operator (and no JobSet): the agent finds the
PyTorchJob API by discovery and makes each multi-node task a PyTorchJob of a Master and Workers of the
task's pod, whose container is `pytorch` so the operator gives it the rendezvous variables. It follows the
PyTorchJob through its pods (the operator's labels) and its own conditions, stops, requeues and cleans up
through it, adopts it after a restart, and hands it to Kueue as one workload. The operator is the tests'
stand-in (tests/agents/kube.py); the client and the API calls are the official ones against kmock."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.backend import Refused
from agents.state import State
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


def test_a_failing_worker_ends_the_task_with_its_exit_code(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("ptf", gpus=2, nodes=2)
    name = pods.job_name("ptf", "lease-ptf")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        master, worker = await asyncio.to_thread(kubelet.make_pytorchjob_pods, name)
        for pod in (master, worker):
            await asyncio.to_thread(kubelet.run, pod)
        await asyncio.to_thread(kubelet.end, worker, 7)
        await asyncio.to_thread(kubelet.end, master, 143)
        await asyncio.to_thread(kubelet.pytorchjob_ended, name, False)
        (result,) = await until(lambda: recorder.of("result"), timeout=20)
        assert result["exit_code"] == 143  # the lowest rank that failed: the master
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_half_a_gang_goes_back_to_the_queue_and_its_pytorchjob_is_deleted(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, gang_seconds=0.5), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("pth", gpus=8, nodes=2)
    name = pods.job_name("pth", "lease-pth")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        master, worker = await asyncio.to_thread(kubelet.make_pytorchjob_pods, name)
        await asyncio.to_thread(kubelet.run, master)
        await asyncio.to_thread(
            kubelet.unschedulable, worker, "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
        )
        (result,) = await until(lambda: recorder.of("result"), timeout=20)
        assert result["requeue"] is True
        assert "Insufficient nvidia.com/gpu" in result["reason"]
        assert await until(lambda: kubelet.gone("PyTorchJob", name))
        assert await until(lambda: not kubelet.pods_of(name))  # nothing of it holds GPUs
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_preempt_deletes_the_pytorchjob_then_its_pods_with_the_grace_period(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("ptp", gpus=2, nodes=2)
    name = pods.job_name("ptp", "lease-ptp")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        made = await asyncio.to_thread(kubelet.make_pytorchjob_pods, name)
        for pod in made:
            await asyncio.to_thread(kubelet.core.patch_namespaced_pod, pod, NAMESPACE,
                                    {"metadata": {"finalizers": ["tests.klique.io/kubelet"]}},
                                    _preload_content=False)  # fmt: skip
            await asyncio.to_thread(kubelet.run, pod)
        await until(lambda: running_states(recorder) == 1)
        await kube.stop("ptp", 11)
        deleted = cluster.requests("DELETE", rf"{PYTORCHJOBS}/{name}")
        assert [query.get("propagationPolicy") for _, _, query in deleted] == ["Orphan"]
        for pod in made:
            deletes = cluster.requests("DELETE", rf"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
            assert [query.get("gracePeriodSeconds") for _, _, query in deletes] == ["11"]
        await asyncio.to_thread(kubelet.write, made[0], "SIGTERM: checkpoint saved")
        await asyncio.sleep(0.3)
        assert not recorder.of("result")  # within its grace
        for pod in made:
            await asyncio.to_thread(kubelet.terminated, pod)
        (result,) = await until(lambda: recorder.of("result"))
        assert result["stopped"] is True
        assert "SIGTERM: checkpoint saved" in recorder.lines()
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_pytorchjob_deleted_outside_klique_ends_the_task(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("ptd", gpus=2, nodes=2)
    name = pods.job_name("ptd", "lease-ptd")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        for _ in range(5):  # listed, and not yet taken for gone
            await kube.look()
        assert not recorder.of("result")
        await asyncio.to_thread(
            kubelet.custom.delete_namespaced_custom_object,
            "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name, _preload_content=False,
        )  # fmt: skip
        kube.created_at[name] = 0.0  # made long ago
        kube.workloads.clear()  # listed at once rather than in WORKLOAD_READ_SECONDS
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] is None
        assert any(f"PyTorchJob {name} was deleted outside Klique" in line for line in recorder.lines())
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_restarted_agent_adopts_its_pytorchjob_and_one_it_never_recorded(
    cluster: Cluster, tmp_path: Path
) -> None:
    kubelet = Kubelet(cluster)
    recorded, unrecorded = assignment("pta", gpus=2, nodes=2), assignment("ptb", gpus=2, nodes=2)
    state_path = tmp_path / "agent.sqlite"

    async def before() -> None:
        kube = backend(cluster, tmp_path, State(state_path))
        recorder = Recorder(kube.state)
        for task in (recorded, unrecorded):
            begin(kube, task)
        await kube.start(recorded, recorder)
        cluster_settings = dataclasses.replace(kube.settings.cluster, multi_node="pytorchjob")
        manifests = pods.render(kube.settings.template_for(""), unrecorded, cluster_settings, tenant="acme")
        await asyncio.to_thread(kube.api.create, manifests.secret)
        await asyncio.to_thread(kube.api.create, manifests.job)  # ... killed before add_job
        await kube.stop_all(0)

    asyncio.run(before())
    for task in ("pta", "ptb"):
        for pod in kubelet.make_pytorchjob_pods(pods.job_name(task, f"lease-{task}")):
            kubelet.run(pod)
            kubelet.write(pod, f"{task} {pod[-8:]} up")

    async def after() -> Recorder:
        kube = backend(cluster, tmp_path, State(state_path))
        recorder = Recorder(kube.state)
        kube.adopt(recorder)
        await until(lambda: kube.running() == ["pta", "ptb"])
        assert {record.kind for record in kube.state.jobs()} == {"PyTorchJob"}
        await kube.start(recorded, recorder)  # assigned again: nothing is made twice
        await until(lambda: running_states(recorder) == 2)
        await until(lambda: len(recorder.lines()) == 4)
        for task in ("pta", "ptb"):
            name = pods.job_name(task, f"lease-{task}")
            for pod in kubelet.pods_of(name):
                await asyncio.to_thread(kubelet.end, pod["metadata"]["name"], 0)
            await asyncio.to_thread(kubelet.pytorchjob_ended, name, True)
        await until(lambda: len(recorder.of("result")) == 2, timeout=20)
        await kube.stop_all(0)
        return recorder

    recorder = asyncio.run(after())
    assert {body["exit_code"] for body in recorder.of("result")} == {0}
    assert len(cluster.requests("POST", PYTORCHJOBS)) == 2


def test_kueue_admits_the_pytorchjob_as_one_workload(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path, local_queue="team-a"), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("ptk", gpus=8, nodes=2)
    name = pods.job_name("ptk", "lease-ptk")
    said = "couldn't assign flavors to pod set master: insufficient unused quota for nvidia.com/gpu"

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        job = await asyncio.to_thread(kubelet.pytorchjob, name)
        assert job["spec"]["runPolicy"]["suspend"] is True
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        workload = {
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": f"pytorchjob-{name}-1a2b3", "namespace": NAMESPACE, "ownerReferences": [
                {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": name, "uid": "u"}]},
            "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                       "message": said}]},
        }  # fmt: skip
        await asyncio.to_thread(
            kubelet.custom.create_namespaced_custom_object,
            "kueue.x-k8s.io", "v1beta1", NAMESPACE, "workloads", workload,
        )  # fmt: skip
        kube.admission_read, kube.workloads = 0.0, {}
        await until(lambda: any(said in body.get("reason", "") for body in recorder.of("status")))
        reason = next(body["reason"] for body in recorder.of("status") if said in body.get("reason", ""))
        assert reason.startswith("waiting for Kueue to admit it into LocalQueue team-a: ")
        await asyncio.to_thread(
            kubelet.custom.patch_namespaced_custom_object,
            "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name, {"spec": {"runPolicy": {"suspend": False}}},
        )  # fmt: skip
        for pod in await asyncio.to_thread(kubelet.make_pytorchjob_pods, name):
            await asyncio.to_thread(kubelet.run, pod)
        await until(lambda: running_states(recorder) == 1)
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


def test_pytorchjob_asked_for_without_the_operator_is_refused_in_words(tmp_path: Path) -> None:
    cluster = Cluster().start()
    try:
        kube = backend(cluster, tmp_path, multi_node="pytorchjob")
        recorder = Recorder(kube.state)
        task = assignment("nopt", gpus=2, nodes=2)

        async def scenario() -> Refused:
            begin(kube, task)
            with pytest.raises(Refused) as refused:
                await kube.start(task, recorder)
            await kube.stop_all(0)
            return refused.value

        refused = asyncio.run(scenario())
        assert "does not serve kubeflow.org/v1 pytorchjobs: install the Kubeflow training operator" in str(
            refused
        )
        assert refused.permanent is False
        assert kube.state.jobs() == []
    finally:
        cluster.stop()
