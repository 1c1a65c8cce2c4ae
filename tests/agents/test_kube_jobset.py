"""Multi-node tasks on a cluster with JobSet: the agent finds the JobSet API by discovery and makes each
multi-node task a JobSet of one Indexed Job (the JobSet controller's headless Service, its pods' names),
follows that Job as it follows its own, waits for the JobSet controller without taking a Job not made yet
for one gone, and reads the JobSet's own condition when its Job went unseen. What every multi-node workload
does alike (failures, half a gang, preemption, deletion, adoption, Kueue) is in test_kube_gangs.py. The
JobSet controller is the tests' stand-in (tests/agents/kube.py); the client and the API calls are the
official ones against kmock's emulator."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.kubernetes import KubeSettings
from agents.state import JobRecord, State
from protocol import pods
from tests.agents.kube import NAMESPACE, Cluster, Kubelet
from tests.agents.test_kubernetes import Recorder, assignment, backend, begin, until

pytestmark = pytest.mark.timeout(120)

JOBSETS = rf"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NAMESPACE}/jobsets"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster(jobset=True).start()
    yield running
    running.stop()


def test_a_multi_node_task_is_a_jobset_whose_job_runs_to_completion(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("js", gpus=8, nodes=2)
    name = pods.job_name("js", "lease-js")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        assert len(cluster.requests("POST", JOBSETS)) == 1
        assert not cluster.requests(
            "POST", rf"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
        )  # its controller's
        assert not cluster.requests("POST", rf"/api/v1/namespaces/{NAMESPACE}/services")  # and its Service
        jobset = await asyncio.to_thread(kubelet.jobset, name)
        assert jobset["metadata"]["labels"]["klique.io/task"] == "js"
        assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}  # the plane retries, not the JobSet
        assert jobset["spec"]["network"]["subdomain"] == name
        (replicated,) = jobset["spec"]["replicatedJobs"]
        assert (replicated["name"], replicated["replicas"]) == ("node", 1)
        job_spec = replicated["template"]["spec"]
        assert job_spec["completionMode"] == "Indexed"
        assert job_spec["completions"] == job_spec["parallelism"] == 2
        assert job_spec["backoffLimit"] == 0
        main = job_spec["template"]["spec"]["containers"][0]
        assert main["resources"]["limits"] == {"nvidia.com/gpu": "4"}
        env = {item["name"]: item for item in main["env"]}
        assert env["MASTER_ADDR"]["value"] == f"{name}-node-0-0.{name}.{NAMESPACE}.svc"
        assert env["WORLD_SIZE"]["value"] == "2"
        assert "HF_TOKEN" not in env  # the secret is in the Secret only
        secret = await asyncio.to_thread(kubelet.secret, name)
        assert secret["stringData"]["HF_TOKEN"].startswith("s3cr3t")
        await until(lambda: (kubelet.secret(name)["metadata"].get("ownerReferences") or [{}])[0].get("kind"))
        owner = (await asyncio.to_thread(kubelet.secret, name))["metadata"]["ownerReferences"][0]
        assert (owner["apiVersion"], owner["kind"], owner["name"]) == (
            "jobset.x-k8s.io/v1alpha2",
            "JobSet",
            name,
        )
        # The JobSet controller makes its Job; the Job controller its pods; they run.
        job = await asyncio.to_thread(kubelet.make_jobset_job, name)
        assert job == f"{name}-node-0"
        first, second = await asyncio.to_thread(kubelet.make_pods, job)
        await asyncio.to_thread(kubelet.run, first)
        await asyncio.sleep(0.3)
        assert not any(body["state"] == "running" for body in recorder.of("status"))  # half a gang
        await asyncio.to_thread(kubelet.run, second)
        await until(lambda: any(body["state"] == "running" for body in recorder.of("status")))
        await asyncio.to_thread(kubelet.write, first, "rank 0 up")
        await asyncio.to_thread(kubelet.write, second, "rank 1 up")
        await until(lambda: len(recorder.lines()) == 2)
        assert {body["stream"] for body in recorder.of("log")} == {"rank-0", "rank-1"}
        await asyncio.to_thread(kubelet.end, first, 0)
        await asyncio.to_thread(kubelet.end, second, 0)
        await asyncio.to_thread(kubelet.job_ended, job, True)
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] == 0
        assert result["cluster"]["kind"] == "JobSet"
        assert result["cluster"]["job_id"] == name
        assert await until(lambda: kubelet.gone("Secret", name))
        assert not kubelet.gone("JobSet", name)  # kept for `kubectl describe` until its TTL
        await kube.stop_all(0)

    asyncio.run(scenario())
    submitted = recorder.of("status")[0]
    assert (submitted["state"], submitted["job_id"]) == ("pending", name)


def test_a_jobset_waits_for_its_controller_and_one_deleted_outside_klique_ends_the_task(
    cluster: Cluster, tmp_path: Path
) -> None:
    """No Job yet is no Job gone: the task waits, saying what it waits for, however long the JobSet
    controller takes; once the JobSet itself is deleted, the task ends saying so."""
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("jsw", gpus=2, nodes=2)
    name = pods.job_name("jsw", "lease-jsw")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        await until(
            lambda: any("JobSet controller" in body.get("reason", "") for body in recorder.of("status"))
        )
        kube.created_at[name] = 0.0  # long ago: a Job would have been taken for gone by now
        kube.workloads.clear()
        for _ in range(5):
            await kube.look()
        assert not recorder.of("result")
        await asyncio.to_thread(kubelet.delete_jobset, name)
        kube.workloads.clear()  # listed at once rather than in WORKLOAD_READ_SECONDS
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] is None
        assert any(f"JobSet {name} was deleted outside Klique" in line for line in recorder.lines())
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_jobset_that_ended_before_its_job_was_seen_ends_the_task(cluster: Cluster, tmp_path: Path) -> None:
    """An agent away while the JobSet ran and its Job went (a TTL): the JobSet's own condition is the word."""
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("jse", gpus=2, nodes=2)
    name = pods.job_name("jse", "lease-jse")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        await asyncio.to_thread(kubelet.jobset_ended, name, False)
        kube.workloads.clear()
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] == 1
        assert any("the JobSet failed: FailedJobs: jobset failed" in line for line in recorder.lines())
        await kube.stop_all(0)

    asyncio.run(scenario())


@pytest.mark.parametrize(("with_jobset", "chosen", "made"), [
    (True, "indexed-job", "jobs"), (False, "auto", "jobs"), (True, "auto", "jobsets"),
])  # fmt: skip
def test_the_workload_follows_the_setting_and_the_cluster(
    with_jobset: bool, chosen: str, made: str, tmp_path: Path
) -> None:
    cluster = Cluster(jobset=with_jobset).start()
    try:
        kube = backend(cluster, tmp_path, multi_node=chosen)
        recorder = Recorder(kube.state)
        one_node, two_nodes = assignment("one", gpus=2), assignment("two", gpus=2, nodes=2)

        async def scenario() -> None:
            for task in (one_node, two_nodes):
                begin(kube, task)
                await kube.start(task, recorder)
            await kube.stop_all(0)

        asyncio.run(scenario())
        jobs = cluster.requests("POST", rf"/apis/batch/v1/namespaces/{NAMESPACE}/jobs")
        jobsets = cluster.requests("POST", JOBSETS)
        assert (len(jobs), len(jobsets)) == ((2, 0) if made == "jobs" else (1, 1))  # one node: always a Job
        services = cluster.requests("POST", rf"/api/v1/namespaces/{NAMESPACE}/services")
        assert len(services) == (1 if made == "jobs" else 0)
    finally:
        cluster.stop()


@pytest.mark.parametrize("value", ["JobSet", "mpi", "", 3])
def test_an_unknown_multi_node_setting_is_refused_when_read(value: object) -> None:
    table = {"multi_node": value}
    if value == "":
        assert KubeSettings.read({"agent": {"kubernetes": table}}, "a").multi_node == "auto"
        return
    with pytest.raises(ValueError, match="multi_node is one of auto, indexed-job, jobset, pytorchjob"):
        KubeSettings.read({"agent": {"kubernetes": table}}, "a")


def test_an_agent_state_from_before_jobsets_reads_its_jobs_as_jobs(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as old:
        old.execute(
            "CREATE TABLE jobs (task_id TEXT PRIMARY KEY, job_id TEXT, folder TEXT, account TEXT, "
            "stopping INTEGER DEFAULT 0, last TEXT DEFAULT '')"
        )
        old.execute("INSERT INTO jobs VALUES ('t', 'k-t-1', 'ml', 'ada', 0, 'running|')")
    state = State(path)
    assert state.jobs() == [JobRecord("t", "k-t-1", "ml", "ada", False, "running|", "Job")]
    state.add_job(JobRecord("u", "k-u-1", "ml", "ada", kind="JobSet"))
    assert [record.kind for record in State(path).jobs()] == ["Job", "JobSet"]
