"""The Kubernetes backend with the official client against kmock's API emulator (tests/agents/kube.py):
Jobs made from pod templates, followed by watch, driven through their lives as a cluster would drive them,
their logs home once each, their outputs uploaded, stopped, adopted after a restart, and the API's
refusals in words an administrator can act on."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from agents.backend import Refused
from agents.kubernetes import Api, Kubernetes, KubeSettings, explain, log_lines, what_is_seen
from agents.state import LogCursor, Position, State
from protocol import pods
from protocol.units import UNITS_PER_GPU
from tests.agents.kube import NAMESPACE, Cluster, Kubelet

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cr3t-value-never-in-a-pod-spec"
LISTS = rf"/api/v1/namespaces/{NAMESPACE}/pods|/apis/batch/v1/namespaces/{NAMESPACE}/jobs"  # both watched


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster().start()
    yield running
    running.stop()


class Recorder:
    """Reports as the agent keeps them: through the state, so log cursors move with them."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.reports: list[tuple[str, str, dict[str, Any]]] = []

    async def __call__(self, task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        self.state.enqueue(task_id, kind, body, offset=offset)
        self.reports.append((task_id, kind, body))

    def of(self, kind: str, task_id: str | None = None) -> list[dict[str, Any]]:
        return [body for task, k, body in self.reports if k == kind and task_id in (None, task)]

    def lines(self, task_id: str | None = None) -> list[str]:
        return [line for body in self.of("log", task_id) for line in body["lines"]]


def settings(cluster: Cluster, tmp_path: Path, **overrides: Any) -> KubeSettings:
    table = {
        "namespace": NAMESPACE,
        "api_url": cluster.url,
        "poll_seconds": 0.05,
        "outputs_dir": str(tmp_path / "volume"),
        "work_volume": {"persistentVolumeClaim": {"claimName": "klique-work"}},
        **overrides,
    }
    return KubeSettings.read({"agent": {"kubernetes": table}}, "agent-1")


def backend(cluster: Cluster, tmp_path: Path, state: State | None = None, **overrides: Any) -> Kubernetes:
    chosen = settings(cluster, tmp_path, **overrides)
    return Kubernetes(chosen, state or State(tmp_path / "agent.sqlite"), Api(chosen))


def assignment(task_id: str, gpus: float = 1, nodes: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "lease_id": f"lease-{task_id}",
        "name": f"train {task_id}",
        "size_units": int(gpus * UNITS_PER_GPU),
        "nodes": nodes,
        "user": "ada@example.com",
        "tenant": "acme",
        "compute_resource": "Research: GPUs",
        "spec": {"command": ["python", "train.py"], "environment": {"EPOCHS": "3"}, "outputs": ["*.json"]},
        "secrets": {"HF_TOKEN": SECRET},
        **extra,
    }


async def until(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = check()  # in the loop's thread: the agent's SQLite is this thread's
        if found:
            return found
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not seen in {timeout} s: {check}")
        await asyncio.sleep(0.05)


def refusal(kube: Kubernetes, task: dict[str, Any]) -> Refused:
    """What the backend says, refusing to start the task (it must refuse); the backend is then stopped."""

    async def scenario() -> Refused:
        begin(kube, task)
        with pytest.raises(Refused) as refused:
            await kube.start(task, Recorder(kube.state))
        await kube.stop_all(0)
        return refused.value

    return asyncio.run(scenario())


def begin(kube: Kubernetes, task: dict[str, Any]) -> None:
    kube.state.lease_begin(task["task_id"], task["lease_id"], 1)


def test_a_whole_gpu_task_runs_to_completion_with_its_logs_and_outputs(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("t1", gpus=2)

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("t1", "lease-t1")
        job = await asyncio.to_thread(kubelet.job, name)
        main = job["spec"]["template"]["spec"]["containers"][0]
        assert main["resources"]["limits"] == {"nvidia.com/gpu": "2"}
        assert main["command"] == ["python", "train.py"]
        assert job["metadata"]["labels"]["klique.io/task"] == "t1"
        assert job["metadata"]["labels"]["klique.io/submitter"] == "ada-example.com"
        assert job["metadata"]["labels"]["klique.io/tenant"] == "acme"
        assert job["spec"]["backoffLimit"] == 0
        secret = await asyncio.to_thread(kubelet.secret, name)
        assert secret["stringData"] == {"EPOCHS": "3", "HF_TOKEN": SECRET}
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name)
        await asyncio.to_thread(kubelet.run, pod)
        await until(lambda: any(body["state"] == "running" for body in recorder.of("status")))
        await asyncio.to_thread(kubelet.write, pod, "epoch 1", "epoch 2")
        await until(lambda: len(recorder.lines()) == 2)
        folder = tmp_path / "volume" / "t1"
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text('{"loss": 0.1}')
        (folder / "model.bin").write_text("not declared")
        await asyncio.to_thread(kubelet.write, pod, "epoch 3")
        await asyncio.to_thread(kubelet.end, pod, 0)
        await asyncio.to_thread(kubelet.job_ended, name, True)
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] == 0
        assert result["stopped"] is False
        assert result["outputs"] == ["metrics.json"]
        assert recorder.lines() == ["epoch 1", "epoch 2", "epoch 3"]
        assert await until(lambda: kubelet.gone("Secret", name))  # the secret does not outlive the run
        assert not kube.state.jobs()
        await kube.stop_all(0)

    uploads: list[str] = []

    async def upload(task_id: str, name: str, path: Path) -> None:
        uploads.append(f"{task_id}/{name}:{path.read_text()}")

    kube.upload = upload
    asyncio.run(scenario())
    assert uploads == ['t1/metrics.json:{"loss": 0.1}']
    states = [body["state"] for body in recorder.of("status")]
    assert states[0] == "pending"
    assert states[-1] == "running"


@pytest.mark.parametrize(
    ("task", "limits", "variables"),
    [
        (assignment("w", gpus=4), {"nvidia.com/gpu": "4"}, {}),
        (assignment("f", gpus=0.5), {"nvidia.com/gpu.shared": "1"}, {"KLIQUE_GPU_MEMORY_FRACTION": "0.5000"}),
        (assignment("m", gpus=1, sharing="mig", mig_profile="1g.10gb"), {"nvidia.com/mig-1g.10gb": "1"}, {}),
    ],
    ids=["whole", "fraction", "mig"],
)
def test_each_size_asks_for_the_gpus_its_profile_counts(
    cluster: Cluster, tmp_path: Path, task: dict[str, Any], limits: dict[str, str], variables: dict[str, str]
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)

    async def scenario() -> dict[str, Any]:
        begin(kube, task)
        await kube.start(task, Recorder(kube.state))
        job = await asyncio.to_thread(kubelet.job, pods.job_name(task["task_id"], task["lease_id"]))
        await kube.stop_all(0)
        return job

    job = asyncio.run(scenario())
    main = job["spec"]["template"]["spec"]["containers"][0]
    assert main["resources"]["limits"] == limits
    env = {item["name"]: item.get("value") for item in main["env"]}
    assert variables.items() <= env.items()
    pods.validate(job)


def test_a_multi_node_task_is_an_indexed_job_with_a_rendezvous_service(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("mn", gpus=8, nodes=2)

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("mn", "lease-mn")
        job = await asyncio.to_thread(kubelet.job, name)
        assert job["spec"]["completionMode"] == "Indexed"
        assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
        spec = job["spec"]["template"]["spec"]
        assert spec["subdomain"] == name
        main = spec["containers"][0]
        assert main["resources"]["limits"] == {"nvidia.com/gpu": "4"}  # per node
        env = {item["name"]: item for item in main["env"]}
        assert env["WORLD_SIZE"]["value"] == "2"
        assert env["MASTER_ADDR"]["value"] == f"{name}-0.{name}.{NAMESPACE}.svc"
        assert "batch.kubernetes.io/job-completion-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert not await asyncio.to_thread(kubelet.gone, "Service", name)
        first, second = await asyncio.to_thread(kubelet.make_pods, name)
        await asyncio.to_thread(kubelet.run, first)
        await asyncio.sleep(0.3)
        assert not any(body["state"] == "running" for body in recorder.of("status"))  # half a gang: waiting
        await asyncio.to_thread(kubelet.run, second)
        await until(lambda: any(body["state"] == "running" for body in recorder.of("status")))
        await asyncio.to_thread(kubelet.write, first, "rank 0 up")
        await asyncio.to_thread(kubelet.write, second, "rank 1 up")
        await until(lambda: len(recorder.lines()) == 2)
        streams = {body["stream"] for body in recorder.of("log")}
        assert streams == {"rank-0", "rank-1"}
        await asyncio.to_thread(kubelet.end, first, 0)
        await asyncio.to_thread(kubelet.end, second, 0)
        await asyncio.to_thread(kubelet.job_ended, name, True)
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] == 0
        assert await until(lambda: kubelet.gone("Service", name))
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_half_a_gang_that_cannot_be_placed_goes_back_to_the_queue(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path, gang_seconds=0.5), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("half", gpus=8, nodes=2)

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("half", "lease-half")
        first, second = await asyncio.to_thread(kubelet.make_pods, name)
        await asyncio.to_thread(kubelet.run, first)
        await asyncio.to_thread(
            kubelet.unschedulable, second, "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
        )
        (result,) = await until(lambda: recorder.of("result"))
        assert result["requeue"] is True
        assert result["exit_code"] is None
        assert "Insufficient nvidia.com/gpu" in result["reason"]
        assert await until(lambda: kubelet.gone("Job", name))
        assert await until(lambda: not kubelet.pods_of(name))  # nothing of it holds GPUs
        await kube.stop_all(0)

    asyncio.run(scenario())
    pending = [body.get("reason", "") for body in recorder.of("status") if body["state"] == "pending"]
    assert any("1 of 2 pods placed" in reason for reason in pending)


@pytest.mark.parametrize(
    ("code", "reason", "said"),
    [(3, "", None), (137, "OOMKilled", "OOMKilled"), (1, "Error", None)],
    ids=["exit-code", "oom", "error"],
)
def test_a_failed_pod_reports_its_exit_code_and_why(
    cluster: Cluster, tmp_path: Path, code: int, reason: str, said: str | None
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("bad")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("bad", "lease-bad")
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name)
        await asyncio.to_thread(kubelet.run, pod)
        await asyncio.to_thread(kubelet.write, pod, "Traceback: boom")
        await asyncio.to_thread(kubelet.end, pod, code, reason)
        await asyncio.to_thread(kubelet.job_ended, name, False)
        await until(lambda: recorder.of("result"))
        await kube.stop_all(0)

    asyncio.run(scenario())
    (result,) = recorder.of("result")
    assert result["exit_code"] == code
    assert "Traceback: boom" in recorder.lines()
    if said:
        assert any(said in line and "memory" in line for line in recorder.lines())


def test_an_unschedulable_pod_waits_with_the_schedulers_own_words(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("wait")
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available."

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        (pod,) = await asyncio.to_thread(kubelet.make_pods, pods.job_name("wait", "lease-wait"))
        await asyncio.to_thread(kubelet.unschedulable, pod, message)
        await until(lambda: any(message in body.get("reason", "") for body in recorder.of("status")))
        assert [row["reason"] for row in kube.queue()] == [f"Unschedulable: {message}"]
        await kube.stop_all(0)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("reason", "patience", "fails"),
    [("InvalidImageName", 300.0, True), ("ImagePullBackOff", 0.3, True), ("ImagePullBackOff", 300.0, False)],
    ids=["hopeless-at-once", "backoff-past-patience", "backoff-within-patience"],
)
def test_an_image_that_cannot_be_pulled(
    cluster: Cluster, tmp_path: Path, reason: str, patience: float, fails: bool
) -> None:
    kube, kubelet = backend(cluster, tmp_path, image_pull_seconds=patience), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("img")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("img", "lease-img")
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name)
        await asyncio.to_thread(kubelet.wait_image, pod, reason, 'pull access denied for "nope/nope"')
        await until(
            lambda: (
                any(reason in body.get("reason", "") for body in recorder.of("status"))
                or recorder.of("result")
            )
        )
        await asyncio.sleep(1.0)
        if fails:
            (result,) = await until(lambda: recorder.of("result"))
            assert result["exit_code"] is None
            assert any("pull access denied" in line for line in recorder.lines())
            assert await until(lambda: kubelet.gone("Job", name))
        else:
            assert not recorder.of("result")
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_preempt_deletes_the_pods_with_the_grace_period_and_reports_stopped(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("pre")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("pre", "lease-pre")
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name, terminating=True)
        await asyncio.to_thread(kubelet.run, pod)
        await until(lambda: any(body["state"] == "running" for body in recorder.of("status")))
        await kube.stop("pre", 7)
        deletes = cluster.requests("DELETE", rf"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")
        assert [query.get("gracePeriodSeconds") for _, _, query in deletes] == ["7"]
        jobs = cluster.requests("DELETE", rf"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/{name}")
        assert [query.get("propagationPolicy") for _, _, query in jobs] == ["Orphan"]
        await asyncio.to_thread(kubelet.write, pod, "SIGTERM: saving a checkpoint")
        await asyncio.sleep(0.3)
        assert not recorder.of("result")  # the pod is still stopping within its grace
        await asyncio.to_thread(kubelet.terminated, pod)
        (result,) = await until(lambda: recorder.of("result"))
        assert result["stopped"] is True
        assert "SIGTERM: saving a checkpoint" in recorder.lines()
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_restarted_agent_adopts_its_job_and_reads_each_line_once(cluster: Cluster, tmp_path: Path) -> None:
    """The agent process dies while the Job runs (its threads and memory gone, its SQLite kept); the next
    one adopts the Job it labelled instead of creating it again, and reads the log on from its cursor."""
    state_path = tmp_path / "agent.sqlite"
    kubelet = Kubelet(cluster)
    task = assignment("adopt")
    name = pods.job_name("adopt", "lease-adopt")
    first_recorder: Recorder

    async def before() -> str:
        nonlocal first_recorder
        kube = backend(cluster, tmp_path, State(state_path))
        first_recorder = Recorder(kube.state)
        begin(kube, task)
        await kube.start(task, first_recorder)
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name)
        await asyncio.to_thread(kubelet.run, pod)
        await asyncio.to_thread(kubelet.write, pod, "one", "two")
        await until(lambda: len(first_recorder.lines()) == 2)
        await kube.stop_all(0)
        return pod

    pod = asyncio.run(before())
    kubelet.write(pod, "three")  # written while no agent runs

    async def after() -> Recorder:
        kube = backend(cluster, tmp_path, State(state_path))
        recorder = Recorder(kube.state)
        assert kube.adopt(recorder) == ["adopt"]
        await kube.start(task, recorder)  # the plane assigns it again: nothing is made twice
        await until(lambda: "three" in recorder.lines())
        await asyncio.to_thread(kubelet.write, pod, "four")
        await asyncio.to_thread(kubelet.end, pod, 0)
        await asyncio.to_thread(kubelet.job_ended, name, True)
        await until(lambda: recorder.of("result"))
        await kube.stop_all(0)
        return recorder

    second = asyncio.run(after())
    assert first_recorder.lines() + second.lines() == ["one", "two", "three", "four"]
    assert len(cluster.requests("POST", rf"/apis/batch/v1/namespaces/{NAMESPACE}/jobs")) == 1


async def succeeds(kubelet: Kubelet, name: str, recorder: Recorder) -> None:
    """The Job's one pod runs and exits 0, the Job succeeds, and the agent reports the result."""
    (pod,) = await asyncio.to_thread(kubelet.make_pods, name)
    await asyncio.to_thread(kubelet.run, pod)
    await asyncio.to_thread(kubelet.end, pod, 0)
    await asyncio.to_thread(kubelet.job_ended, name, True)
    await until(lambda: recorder.of("result"))


def test_a_job_made_by_an_agent_killed_before_it_recorded_it_is_adopted(
    cluster: Cluster, tmp_path: Path
) -> None:
    kubelet = Kubelet(cluster)
    task = assignment("orphan")
    state = State(tmp_path / "agent.sqlite")
    first = backend(cluster, tmp_path, state)
    begin(first, task)
    manifests = pods.render(first.settings.template_for(""), task, first.settings.cluster, tenant="acme")
    first.api.create(manifests.secret)
    first.api.create(manifests.job)  # ... and the process was killed here, before add_job

    async def scenario() -> Recorder:
        kube = backend(cluster, tmp_path, State(tmp_path / "agent.sqlite"))
        recorder = Recorder(kube.state)
        kube.adopt(recorder)
        await until(lambda: kube.running() == ["orphan"])
        await succeeds(kubelet, manifests.job["metadata"]["name"], recorder)
        await kube.stop_all(0)
        return recorder

    recorder = asyncio.run(scenario())
    assert recorder.of("result")[0]["exit_code"] == 0


def secrets_and_services(cluster: Cluster) -> set[str]:
    core = client.CoreV1Api(cluster.api())
    secrets = json.loads(core.list_namespaced_secret(NAMESPACE, _preload_content=False).data)["items"]
    services = json.loads(core.list_namespaced_service(NAMESPACE, _preload_content=False).data)["items"]
    return {f"{kind}/{item['metadata']['name']}"
            for kind, items in (("Secret", secrets), ("Service", services)) for item in items}  # fmt: skip


def half_made(cluster: Cluster, tmp_path: Path, task: dict[str, Any], *, job: bool = False) -> str:
    """What an agent killed while it made the run left: its lease in the state, its Secret and Service,
    and its Job where `job`. The run's name."""
    first = backend(cluster, tmp_path)
    begin(first, task)
    manifests = pods.render(first.settings.template_for(""), task, first.settings.cluster, tenant="acme")
    first.api.create(manifests.secret)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": manifests.job["metadata"]["name"]},
               "spec": {"ports": [{"port": 8000}]}}  # fmt: skip
    first.api.create(service)
    if job:
        first.api.create(manifests.job)
    return str(manifests.job["metadata"]["name"])


def test_what_an_agent_killed_before_it_made_the_job_left_is_deleted_by_the_next(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Its Secret holds the run's secrets: nothing would own it, and the Role may not list Secrets."""
    name = half_made(cluster, tmp_path, assignment("half"))
    assert {f"Secret/{name}", f"Service/{name}"} <= secrets_and_services(cluster)

    async def scenario() -> None:
        kube = backend(cluster, tmp_path)
        assert kube.adopt(Recorder(kube.state)) == []
        await until(lambda: kube.synced == {"Job", "Pod"})
        await kube.look()
        assert not kube.unmade
        await kube.stop_all(0)

    asyncio.run(scenario())
    assert not {f"Secret/{name}", f"Service/{name}"} & secrets_and_services(cluster)
    assert not cluster.requests("POST", rf"/apis/batch/v1/namespaces/{NAMESPACE}/jobs")


def test_a_run_assigned_again_before_the_sweep_is_made_whole_and_kept(
    cluster: Cluster, tmp_path: Path
) -> None:
    task = assignment("again")
    name = half_made(cluster, tmp_path, task)

    async def scenario() -> None:
        kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
        recorder = Recorder(kube.state)
        kube.adopt(recorder)
        await kube.start(task, recorder)  # the plane assigns the run again: its Secret is refreshed, kept
        await until(lambda: kube.synced == {"Job", "Pod"})
        await kube.look()
        assert f"Secret/{name}" in secrets_and_services(cluster)
        await succeeds(kubelet, name, recorder)
        await kube.stop_all(0)

    asyncio.run(scenario())
    assert len(cluster.requests("POST", rf"/apis/batch/v1/namespaces/{NAMESPACE}/jobs")) == 1


def test_a_run_whose_job_was_made_keeps_what_it_made(cluster: Cluster, tmp_path: Path) -> None:
    name = half_made(cluster, tmp_path, assignment("whole"), job=True)

    async def scenario() -> None:
        kube = backend(cluster, tmp_path)
        kube.adopt(Recorder(kube.state))
        await until(lambda: kube.running() == ["whole"])
        await kube.look()
        await kube.stop_all(0)

    asyncio.run(scenario())
    assert {f"Secret/{name}", f"Service/{name}"} <= secrets_and_services(cluster)
    assert not cluster.requests("DELETE", rf"/api/v1/namespaces/{NAMESPACE}/secrets/.*")


def test_a_run_of_another_lease_left_half_made_goes_and_the_new_run_is_made(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The plane gave the task to this agent again under a new lease: the old run's objects are swept."""
    old = half_made(cluster, tmp_path, assignment("moved"))
    task = assignment("moved", lease_id="lease-new")

    async def scenario() -> str:
        kube = backend(cluster, tmp_path)
        recorder = Recorder(kube.state)
        kube.adopt(recorder)
        begin(kube, task)
        await kube.start(task, recorder)
        await until(lambda: kube.synced == {"Job", "Pod"})
        await kube.look()
        await kube.stop_all(0)
        return str(kube.state.jobs()[0].job_id)

    new = asyncio.run(scenario())
    assert new != old
    left = secrets_and_services(cluster)
    assert f"Secret/{new}" in left
    assert not {f"Secret/{old}", f"Service/{old}"} & left


def test_nothing_of_a_run_is_made_before_its_lease_is_on_disk(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent commits its state once per turn: a start waits for the commit that holds the run's
    lease, and where none comes it refuses (not for good) having made nothing."""
    monkeypatch.setattr("agents.kubernetes.LEASE_WRITE_SECONDS", 0.3)
    committed: list[int] = []

    async def scenario(commit: bool) -> None:
        kube = backend(cluster, tmp_path, State(tmp_path / f"{commit}.sqlite"))
        loop = asyncio.get_running_loop()

        def write() -> None:
            kube.state.commit()
            committed.append(kube.state.commits)

        def opened() -> None:  # as the agent's loop does: commit on its next turn
            if commit:
                loop.call_soon(write)

        kube.state.group_commits(opened)
        task = assignment("disk" if commit else "nodisk")
        begin(kube, task)
        if commit:
            await kube.start(task, Recorder(kube.state))
            assert committed
            assert kube.state.lease("disk") == "lease-disk"
        else:
            with pytest.raises(Refused) as refused:
                await kube.start(task, Recorder(kube.state))
            assert not refused.value.permanent
            assert "could not be written" in str(refused.value)
            kube.state.rollback()  # the transaction that never came to be written
        kube.state.group_commits(None)
        await kube.stop_all(0)

    asyncio.run(scenario(commit=False))
    assert not cluster.requests("POST", rf"/api/v1/namespaces/{NAMESPACE}/secrets")
    asyncio.run(scenario(commit=True))
    assert len(cluster.requests("POST", rf"/api/v1/namespaces/{NAMESPACE}/secrets")) == 1


@pytest.mark.parametrize("cut", ["dropped", "gone"])
def test_the_watch_resumes_after_a_drop_and_lists_again_after_410(
    cluster: Cluster, tmp_path: Path, cut: str
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("w")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("w", "lease-w")
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name)
        await until(lambda: kube.seen_pods)
        assert cluster.emulator is not None
        lists_before = len(cluster.requests("GET", LISTS))
        if cut == "gone":
            cluster.call(lambda: setattr(cluster.emulator, "gone_next", 2))
        assert cluster.cut_watches() >= 1
        await asyncio.to_thread(kubelet.run, pod)  # happens while the watch is away
        await until(lambda: any(body["state"] == "running" for body in recorder.of("status")))
        await asyncio.to_thread(kubelet.end, pod, 0)
        await asyncio.to_thread(kubelet.job_ended, name, True)
        await until(lambda: recorder.of("result"))
        listed = [q for _, _, q in cluster.requests("GET", LISTS)[lists_before:] if q.get("watch") != "true"]
        assert bool(listed) == (cut == "gone")  # a drop resumes the watch; only 410 lists again
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_an_agent_that_stops_while_its_watches_open_leaves_none_open(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop_all comes while each watch's request is on its way (the API server slow to answer): the watch
    opened after it must end at once, not hold its thread and connection for its whole timeout."""
    kube = backend(cluster, tmp_path, watch_seconds=120)
    opening = threading.Event()
    for api, name in ((kube.api.batch, "list_namespaced_job"), (kube.api.core, "list_namespaced_pod")):
        listed = getattr(api, name)

        def slowly(*args: Any, _listed: Any = listed, **options: Any) -> Any:
            if options.get("watch"):
                opening.set()
                time.sleep(0.5)  # stop_all comes now
            return _listed(*args, **options)

        monkeypatch.setattr(api, name, slowly)

    async def scenario() -> None:
        kube.adopt(Recorder(kube.state))
        await asyncio.to_thread(opening.wait, 10)
        await kube.stop_all(0)
        deadline = time.monotonic() + 5
        while any(thread.name.startswith("watch-") for thread in threading.enumerate()):
            assert time.monotonic() < deadline, "a watch opened after stop_all is still open"
            await asyncio.sleep(0.05)

    asyncio.run(scenario())


def test_rbac_that_forbids_creating_jobs_is_said_in_words_an_administrator_can_act_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube = backend(cluster, tmp_path)
    assert cluster.emulator is not None
    cluster.emulator.refused.append(("POST", re.compile(r"/apis/batch/v1/namespaces/[^/]+/jobs")))

    refused = refusal(kube, assignment("rbac"))
    assert "may not create jobs in namespace ml: apply the chart's Role" in str(refused)
    assert refused.permanent is False  # the task waits in the queue; an administrator fixes the Role
    kube._synced("Job", [])  # the watch lists again, as it may at any moment: reading works, creating not
    assert "may not create jobs" in kube.problem
    assert Kubelet(cluster).gone("Secret", pods.job_name("rbac", "lease-rbac"))  # nothing left behind


def test_an_unreachable_api_server_keeps_the_task_queued(tmp_path: Path) -> None:
    unreachable = Cluster(url="http://127.0.0.1:9")  # nothing listens on the discard port
    kube = backend(unreachable, tmp_path)

    async def scenario() -> Refused:
        begin(kube, assignment("down"))
        with pytest.raises(Refused) as refused:
            await kube.start(assignment("down"), Recorder(kube.state))
        await kube.stop_all(0)
        return refused.value

    refused = asyncio.run(scenario())
    assert "cannot be reached" in str(refused)
    assert refused.permanent is False
    assert not kube.state.jobs()


def test_secrets_reach_the_jobs_secret_and_nothing_else(
    cluster: Cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    caplog.set_level(logging.DEBUG)

    async def scenario() -> dict[str, Any]:
        begin(kube, assignment("sec"))
        await kube.start(assignment("sec"), Recorder(kube.state))
        job = await asyncio.to_thread(kubelet.job, pods.job_name("sec", "lease-sec"))
        await kube.stop_all(0)
        return job

    job = asyncio.run(scenario())
    assert SECRET not in str(job)
    main = job["spec"]["template"]["spec"]["containers"][0]
    assert {"secretRef": {"name": job["metadata"]["name"]}} in main["envFrom"]
    assert SECRET in str(kubelet.secret(job["metadata"]["name"]))
    assert SECRET not in caplog.text
    for _, path, query in cluster.requests("GET", r".*") + cluster.requests("POST", r".*"):
        assert SECRET not in path + str(query)


def test_a_template_that_asks_for_more_gpus_than_the_profile_is_refused_for_good(
    cluster: Cluster, tmp_path: Path
) -> None:
    template = (
        "spec:\n  containers:\n    - name: main\n      image: x\n"
        "      resources:\n        limits:\n          nvidia.com/gpu: 8\n"
    )
    with pytest.raises(
        pods.PodTemplateInvalid, match=r"'Research: GPUs', line 7: it asks for 8 nvidia.com/gpu"
    ):
        settings(cluster, tmp_path, templates={"Research: GPUs": template})


def test_log_lines_after_a_cursor_are_neither_skipped_nor_doubled() -> None:
    text = "2026-01-01T00:00:01.000000001Z a\n2026-01-01T00:00:01.000000001Z b\n2026-01-01T00:00:02.5Z c\n"
    lines, cursor = log_lines(text, LogCursor("p", "", 0))
    assert lines == ["a", "b", "c"]
    assert cursor == LogCursor("p", "2026-01-01T00:00:02.5Z", 1)
    again, _ = log_lines(text + "2026-01-01T00:00:02.5Z d\n2026-01-01T00:00:03Z e", cursor)
    assert again == ["d"]  # "e" has no newline yet: read next time, whole
    partial, after = log_lines(text, LogCursor("p", "2026-01-01T00:00:01.000000001Z", 1))
    assert partial == ["b", "c"]
    assert after.since == "2026-01-01T00:00:02.5Z"


def test_capacity_counts_gpus_per_class_and_mig_profile(cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    nodes = [
        {
            "metadata": {"name": "a", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
            "status": {"allocatable": {"cpu": "96", "nvidia.com/gpu": "8"}},
        },
        {
            "metadata": {"name": "b", "labels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}},
            "status": {"allocatable": {"cpu": "64", "nvidia.com/mig-1g.10gb": "14"}},
        },
    ]
    for node in nodes:
        kubelet.core.create_node({"apiVersion": "v1", "kind": "Node", **node}, _preload_content=False)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "other"},
        "spec": {
            "nodeName": "a",
            "containers": [
                {"name": "c", "resources": {"requests": {"cpu": "8"}, "limits": {"nvidia.com/gpu": "2"}}}
            ],
        },
        "status": {"phase": "Running"},
    }
    kubelet.core.create_namespaced_pod("other", pod, _preload_content=False)
    found = asyncio.run(kube.capacity())
    assert found["nodes"] == 2
    assert found["cpus"] == 160
    assert found["cpus_in_use"] == 8
    assert {
        "class": "NVIDIA-H100-80GB-HBM3",
        "resource": "nvidia.com/gpu",
        "allocatable": 8,
        "allocated": 2,
    } in found["gpus"]
    assert {
        "class": "NVIDIA-A100-SXM4-80GB",
        "resource": "nvidia.com/mig-1g.10gb",
        "allocatable": 14,
        "allocated": 0,
    } in found["gpus"]


def test_a_job_waiting_for_kueue_says_what_kueue_says_and_runs_once_admitted(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, local_queue="team-a"), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("kq", gpus=4)
    said = (
        "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor h100"
    )

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("kq", "lease-kq")
        job = await asyncio.to_thread(kubelet.job, name)
        assert job["spec"]["suspend"] is True
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        workload = {
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": f"job-{name}-1a2b3", "namespace": NAMESPACE, "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": "u"}]},
            "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                       "message": said}]},
        }  # fmt: skip
        await asyncio.to_thread(
            kubelet.custom.create_namespaced_custom_object,
            "kueue.x-k8s.io", "v1beta1", NAMESPACE, "workloads", workload,
        )  # fmt: skip
        kube.admission_read = 0.0  # read now, not in ADMISSION_SECONDS
        await until(lambda: any(said in body.get("reason", "") for body in recorder.of("status")))
        reason = next(body["reason"] for body in recorder.of("status") if said in body.get("reason", ""))
        assert reason.startswith("waiting for Kueue to admit it into LocalQueue team-a: ")
        # Kueue admits it: the Job is unsuspended, its pods start.
        await asyncio.to_thread(
            kubelet.batch.patch_namespaced_job, name, NAMESPACE, {"spec": {"suspend": False}}
        )
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name)
        await asyncio.to_thread(kubelet.run, pod)
        await until(lambda: any(body["state"] == "running" for body in recorder.of("status")))
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_without_kueue_a_suspended_job_waits_with_plain_words(cluster: Cluster, tmp_path: Path) -> None:
    """No Workloads API (Kueue absent or its objects not readable): the generic reason, no complaint."""
    kube = backend(cluster, tmp_path, local_queue="team-a")
    assert cluster.emulator is not None
    cluster.emulator.refused.append(("GET", re.compile(r"/apis/kueue.x-k8s.io/.*")))
    recorder = Recorder(kube.state)

    async def scenario() -> None:
        begin(kube, assignment("nk"))
        await kube.start(assignment("nk"), recorder)
        await until(
            lambda: any("waiting for Kueue" in body.get("reason", "") for body in recorder.of("status"))
        )
        await asyncio.sleep(0.3)
        await kube.stop_all(0)

    asyncio.run(scenario())
    assert kube.problem == ""


def test_a_job_the_watch_has_not_shown_yet_is_waited_for_and_one_deleted_outside_klique_ends(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The watch lags the create: a Job not yet seen is not taken for deleted. One that `kubectl delete`
    removes is: the task ends, saying so."""
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("lag")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        name = pods.job_name("lag", "lease-lag")
        kube.seen_jobs.pop(name, None)  # as if the watch had not delivered it yet
        for _ in range(5):
            await kube.look()
        assert not recorder.of("result")
        await asyncio.to_thread(  # a change the watch delivers, whatever it had delivered before
            kubelet.batch.patch_namespaced_job, name, NAMESPACE, {"metadata": {"annotations": {"seen": "1"}}}
        )
        await until(lambda: name in kube.seen_jobs)  # the watch catches up
        await asyncio.to_thread(kubelet.batch.delete_namespaced_job, name, NAMESPACE)
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] is None
        assert any("was deleted outside Klique" in line for line in recorder.lines())
        await kube.stop_all(0)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("status", "words"),
    [
        (401, "refused the agent's credentials (401 Unauthorized): give it a valid kubeconfig"),
        (403, "may not create jobs in namespace ml: apply the chart's Role"),
        (404, "namespace ml or the jobs API is not found"),
        (422, "Kubernetes refused to create jobs in namespace ml (422): spec.template: Invalid value"),
    ],
)
def test_each_api_refusal_is_worded_for_an_administrator(status: int, words: str) -> None:
    from kubernetes.client.exceptions import ApiException

    error = ApiException(status=status, reason="refused")
    error.body = '{"kind": "Status", "message": "spec.template: Invalid value"}'
    problem = explain(error, "create", "jobs", "ml", "https://k8s.example:6443")
    assert words in str(problem)
    assert problem.permanent == (status == 422)  # only a manifest Kubernetes refuses fails for good


def test_an_evicted_pod_ends_its_task_saying_why() -> None:
    job = {
        "spec": {},
        "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}]},
    }
    pod = {
        "metadata": {"name": "k-t-l-0-abc"},
        "status": {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory.",
        },
    }
    seen = what_is_seen(job, [pod], local_queue="")
    assert (seen.state, seen.reason, seen.exit_code) == ("ended", "Evicted", 137)
    assert seen.lines == ("kubernetes: pod k-t-l-0-abc was evicted: The node was low on resource: memory.",)


def test_declared_volumes_reach_the_job_and_one_the_pool_does_not_offer_is_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    offered = {
        "datasets": {"path": "/datasets", "source": {"persistentVolumeClaim": {"claimName": "imagenet"}}}
    }
    kube, kubelet = backend(cluster, tmp_path, volumes=offered), Kubelet(cluster)
    spec = {"command": ["python", "train.py"], "volumes": ["datasets"]}
    wanted, unknown = assignment("vol", spec=spec), assignment("novol", spec={**spec, "volumes": ["secrets"]})

    async def scenario() -> tuple[dict[str, Any], Refused]:
        begin(kube, wanted)
        await kube.start(wanted, Recorder(kube.state))
        job = await asyncio.to_thread(kubelet.job, pods.job_name("vol", "lease-vol"))
        begin(kube, unknown)
        with pytest.raises(Refused) as refused:
            await kube.start(unknown, Recorder(kube.state))
        await kube.stop_all(0)
        return job, refused.value

    job, refused = asyncio.run(scenario())
    pod = job["spec"]["template"]["spec"]
    assert {"name": "klique-v-datasets", "persistentVolumeClaim": {"claimName": "imagenet"}} in pod["volumes"]
    mount = {"name": "klique-v-datasets", "mountPath": "/datasets", "readOnly": True}
    assert mount in pod["containers"][0]["volumeMounts"]
    assert refused.permanent
    assert "volume 'secrets', which this pool does not offer (it offers: datasets)" in str(refused)
    assert [item["metadata"]["name"] for item in kubelet.jobs()] == [job["metadata"]["name"]]  # none made


def test_volumes_the_configuration_cannot_offer_are_refused_when_it_is_read(tmp_path: Path) -> None:
    source = {"persistentVolumeClaim": {"claimName": "x"}}
    for volumes, says in (
        ({"data": {"path": "/shared/data", "source": source}}, "the shared file system's path"),
        ({"data": {"path": "relative", "source": source}}, "absolute path"),
        ({"data": {"path": "/data", "source": {"hostPath": {"pat": "/"}}}}, "refused by Kubernetes"),
    ):
        table = {"namespace": NAMESPACE, "shared_path": "/shared", "volumes": volumes}
        with pytest.raises(ValueError, match=says):
            KubeSettings.read({"agent": {"kubernetes": table}}, "agent-1")


def test_a_job_that_ended_is_not_adopted_again_while_its_result_waits_for_the_plane(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The Job and its pod stay until their TTL; listing them again (after 410 Gone) before the plane
    answered the result must not take the run up again, or its result and log would go out twice."""
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("once")
    name = pods.job_name("once", "lease-once")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        (pod,) = await asyncio.to_thread(kubelet.make_pods, name)
        await asyncio.to_thread(kubelet.run, pod)
        await asyncio.to_thread(kubelet.write, pod, "one", "two")
        await asyncio.to_thread(kubelet.end, pod, 0)
        await asyncio.to_thread(kubelet.job_ended, name, True)
        await until(lambda: recorder.of("result"))
        for kind in ("Job", "Pod"):
            items, _ = await asyncio.to_thread(kube.api.listing, kind)
            kube._synced(kind, items)
        for _ in range(5):
            await kube.look()
        assert kube.running() == []
        await kube.stop_all(0)

    asyncio.run(scenario())
    assert len(recorder.of("result")) == 1
    assert recorder.lines() == ["one", "two"]
