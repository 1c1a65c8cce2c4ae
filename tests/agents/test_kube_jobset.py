"""Multi-node tasks on a cluster with JobSet: the agent finds the JobSet API by discovery and makes each
multi-node task a JobSet of one Indexed Job (the JobSet controller's headless Service, its pods' names),
follows that Job as it follows its own, stops, requeues and cleans up through the JobSet, adopts it after
a restart, and hands it to Kueue as one workload. The JobSet controller is the tests' stand-in
(tests/agents/kube.py); the client and the API calls are the official ones against kmock's emulator."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.backend import Refused
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


def test_a_failing_rank_ends_the_task_with_its_exit_code(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("jsf", gpus=2, nodes=2)
    name = pods.job_name("jsf", "lease-jsf")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        job = await asyncio.to_thread(kubelet.make_jobset_job, name)
        first, second = await asyncio.to_thread(kubelet.make_pods, job)
        for pod in (first, second):
            await asyncio.to_thread(kubelet.run, pod)
        await asyncio.to_thread(kubelet.end, second, 3)
        await asyncio.to_thread(kubelet.end, first, 143)
        await asyncio.to_thread(kubelet.job_ended, job, False)
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] == 143  # the lowest index that failed
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_half_a_gang_goes_back_to_the_queue_and_its_jobset_is_deleted(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, gang_seconds=0.5), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("jsh", gpus=8, nodes=2)
    name = pods.job_name("jsh", "lease-jsh")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        job = await asyncio.to_thread(kubelet.make_jobset_job, name)
        first, second = await asyncio.to_thread(kubelet.make_pods, job)
        await asyncio.to_thread(kubelet.run, first)
        await asyncio.to_thread(
            kubelet.unschedulable, second, "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
        )
        (result,) = await until(lambda: recorder.of("result"))
        assert result["requeue"] is True
        assert "Insufficient nvidia.com/gpu" in result["reason"]
        assert await until(lambda: kubelet.gone("JobSet", name))
        assert await until(lambda: not kubelet.pods_of(job))  # nothing of it holds GPUs
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_preempt_deletes_the_jobset_and_its_job_then_the_pods_with_the_grace_period(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("jsp", gpus=2, nodes=2)
    name = pods.job_name("jsp", "lease-jsp")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        job = await asyncio.to_thread(kubelet.make_jobset_job, name)
        made = await asyncio.to_thread(kubelet.make_pods, job, terminating=True)
        for pod in made:
            await asyncio.to_thread(kubelet.run, pod)
        await until(lambda: any(body["state"] == "running" for body in recorder.of("status")))
        await kube.stop("jsp", 9)
        deleted = cluster.requests("DELETE", rf"{JOBSETS}/{name}")
        assert [query.get("propagationPolicy") for _, _, query in deleted] == ["Orphan"]
        jobs = cluster.requests("DELETE", rf"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/{job}")
        assert [query.get("propagationPolicy") for _, _, query in jobs] == ["Orphan"]
        for pod in made:
            deletes = cluster.requests("DELETE", rf"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
            assert [query.get("gracePeriodSeconds") for _, _, query in deletes] == ["9"]
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
        kube.workloads.clear()  # read it at once rather than in JOBSET_READ_SECONDS
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


def test_a_restarted_agent_adopts_its_jobset_and_one_it_never_recorded(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The JobSet kind is kept in the agent's state; a JobSet made by an agent killed before it recorded it
    is found through its Job's labels. Neither is made twice."""
    kubelet = Kubelet(cluster)
    recorded, unrecorded = assignment("jsa", gpus=2, nodes=2), assignment("jsb", gpus=2, nodes=2)
    state_path = tmp_path / "agent.sqlite"

    async def before() -> None:
        kube = backend(cluster, tmp_path, State(state_path))
        recorder = Recorder(kube.state)
        for task in (recorded, unrecorded):
            begin(kube, task)
        await kube.start(recorded, recorder)
        jobset_on = await kube._multi_node()
        assert jobset_on == "jobset"
        manifests = pods.render(
            kube.settings.template_for(""),
            unrecorded,
            dataclasses.replace(kube.settings.cluster, multi_node="jobset"),
            tenant="acme",
        )
        await asyncio.to_thread(kube.api.create, manifests.secret)
        await asyncio.to_thread(kube.api.create, manifests.job)  # ... killed before add_job
        await kube.stop_all(0)

    asyncio.run(before())
    for task in ("jsa", "jsb"):
        job = kubelet.make_jobset_job(pods.job_name(task, f"lease-{task}"))
        for pod in kubelet.make_pods(job):
            kubelet.run(pod)

    async def after() -> Recorder:
        kube = backend(cluster, tmp_path, State(state_path))
        recorder = Recorder(kube.state)
        kube.adopt(recorder)
        await until(lambda: kube.running() == ["jsa", "jsb"])
        assert {record.kind for record in kube.state.jobs()} == {"JobSet"}
        await kube.start(recorded, recorder)  # assigned again: nothing is made twice
        await until(lambda: len([body for body in recorder.of("status") if body["state"] == "running"]) == 2)
        for task in ("jsa", "jsb"):
            job = f"{pods.job_name(task, f'lease-{task}')}-node-0"
            for pod in kubelet.pods_of(job):
                await asyncio.to_thread(kubelet.end, pod["metadata"]["name"], 0)
            await asyncio.to_thread(kubelet.job_ended, job, True)
        await until(lambda: len(recorder.of("result")) == 2)
        await kube.stop_all(0)
        return recorder

    recorder = asyncio.run(after())
    assert {body["exit_code"] for body in recorder.of("result")} == {0}
    assert len(cluster.requests("POST", JOBSETS)) == 2


def test_kueue_admits_the_jobset_as_one_workload(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path, local_queue="team-a"), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("jsk", gpus=8, nodes=2)
    name = pods.job_name("jsk", "lease-jsk")
    said = (
        "couldn't assign flavors to pod set node: insufficient unused quota for nvidia.com/gpu in flavor h100"
    )

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        jobset = await asyncio.to_thread(kubelet.jobset, name)
        assert jobset["spec"]["suspend"] is True
        assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        inner = jobset["spec"]["replicatedJobs"][0]["template"]
        assert "kueue.x-k8s.io/queue-name" not in inner["metadata"]["labels"]  # one workload: the JobSet
        assert "suspend" not in inner["spec"]
        workload = {
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": f"jobset-{name}-1a2b3", "namespace": NAMESPACE, "ownerReferences": [
                {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": name, "uid": "u"}]},
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
        # Kueue admits it; the JobSet controller makes its Job, which runs.
        await asyncio.to_thread(
            kubelet.custom.patch_namespaced_custom_object,
            "jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets", name, {"spec": {"suspend": False}},
        )  # fmt: skip
        job = await asyncio.to_thread(kubelet.make_jobset_job, name)
        for pod in await asyncio.to_thread(kubelet.make_pods, job):
            await asyncio.to_thread(kubelet.run, pod)
        await until(lambda: any(body["state"] == "running" for body in recorder.of("status")))
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


def test_jobset_asked_for_on_a_cluster_without_it_is_refused_in_words(tmp_path: Path) -> None:
    cluster = Cluster(jobset=False).start()
    try:
        kube = backend(cluster, tmp_path, multi_node="jobset")
        recorder = Recorder(kube.state)
        task = assignment("nojs", gpus=2, nodes=2)

        async def scenario() -> Refused:
            begin(kube, task)
            with pytest.raises(Refused) as refused:
                await kube.start(task, recorder)
            await kube.stop_all(0)
            return refused.value

        refused = asyncio.run(scenario())
        assert "The multi-node workload was not created" in str(refused)
        assert "does not serve jobset.x-k8s.io/v1alpha2 jobsets: install JobSet" in str(refused)
        assert refused.permanent is False  # the task waits for JobSet, or for another pool
        assert kube.state.jobs() == []
        assert Kubelet(cluster).gone("Secret", pods.job_name("nojs", "lease-nojs"))  # nothing left behind
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
