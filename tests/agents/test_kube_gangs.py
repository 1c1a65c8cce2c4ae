"""What every multi-node workload the agent makes must do alike, on a JobSet and on a PyTorchJob: a failing
rank's exit code, half a gang given back to the queue with its workload deleted, preemption with the grace
period, a workload deleted outside Klique, adoption after a restart (also of one the agent never recorded)
and Kueue admitting the workload as one. The controllers are the tests' stand-ins (tests/agents/kube.py);
what makes each kind its own is in test_kube_jobset.py and test_kube_pytorchjob.py."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agents import kubernetes
from agents.state import State
from protocol import pods
from tests.agents.kube import NAMESPACE, Cluster, Kubelet
from tests.agents.test_kubernetes import Recorder, assignment, backend, begin, refusal, until

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Gang:
    """One kind of multi-node workload, and what its controller does, through the stand-ins."""

    kind: str  # JobSet, PyTorchJob
    multi_node: str  # the agent's setting that makes it

    @property
    def path(self) -> str:
        group, version, plural = pods.CUSTOM_WORKLOADS[self.kind]
        return rf"/apis/{group}/{version}/namespaces/{NAMESPACE}/{plural}"

    def cluster(self) -> Cluster:
        return Cluster(jobset=self.kind == "JobSet", pytorchjob=self.kind == "PyTorchJob")

    def group(self, workload: str) -> str:
        """What kubelet.pods_of takes: the JobSet's Job, or the PyTorchJob itself."""
        return pods.followed_job(self.kind, workload)

    def make_pods(self, kubelet: Kubelet, workload: str, *, terminating: bool = False) -> list[str]:
        if self.kind == "JobSet":
            return kubelet.make_pods(kubelet.make_jobset_job(workload), terminating=terminating)
        return kubelet.make_pytorchjob_pods(workload, terminating=terminating)

    def ended(self, kubelet: Kubelet, workload: str, ok: bool) -> None:
        if self.kind == "JobSet":
            kubelet.job_ended(self.group(workload), ok)
        else:
            kubelet.pytorchjob_ended(workload, ok)

    def delete(self, kubelet: Kubelet, workload: str) -> None:
        group, version, plural = pods.CUSTOM_WORKLOADS[self.kind]
        kubelet.custom.delete_namespaced_custom_object(
            group, version, NAMESPACE, plural, workload, _preload_content=False
        )

    def admit(self, kubelet: Kubelet, workload: str) -> None:
        """What Kueue does on admission: the workload is unsuspended."""
        group, version, plural = pods.CUSTOM_WORKLOADS[self.kind]
        patch: dict[str, Any] = (
            {"spec": {"suspend": False}}
            if self.kind == "JobSet"
            else {"spec": {"runPolicy": {"suspend": False}}}
        )
        kubelet.custom.patch_namespaced_custom_object(
            group, version, NAMESPACE, plural, workload, patch, _preload_content=False
        )

    def suspended(self, made: dict[str, Any]) -> bool:
        spec = made["spec"]
        return bool(spec.get("suspend") if self.kind == "JobSet" else spec["runPolicy"].get("suspend"))

    def read(self, kubelet: Kubelet, workload: str) -> dict[str, Any]:
        return kubelet.jobset(workload) if self.kind == "JobSet" else kubelet.pytorchjob(workload)


GANGS = [Gang("JobSet", "jobset"), Gang("PyTorchJob", "pytorchjob")]


@pytest.fixture(params=GANGS, ids=[gang.kind for gang in GANGS])
def gang(request: pytest.FixtureRequest) -> Gang:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def cluster(gang: Gang) -> Iterator[Cluster]:
    running = gang.cluster().start()
    yield running
    running.stop()


def running_states(recorder: Recorder) -> int:
    return len([body for body in recorder.of("status") if body["state"] == "running"])


def test_a_failing_rank_ends_the_task_with_the_lowest_failing_ranks_exit_code(
    gang: Gang, cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("fail", gpus=2, nodes=2)
    name = pods.job_name("fail", "lease-fail")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        first, second = await asyncio.to_thread(gang.make_pods, kubelet, name)
        for pod in (first, second):
            await asyncio.to_thread(kubelet.run, pod)
        # Rank 0 ends first: whether the agent looks before or after rank 1 ends too, the lowest failing
        # rank is rank 0 (a poll between the two ends must not make the answer depend on timing).
        await asyncio.to_thread(kubelet.end, first, 143)
        await asyncio.to_thread(kubelet.end, second, 3)
        await asyncio.to_thread(gang.ended, kubelet, name, False)
        (result,) = await until(lambda: recorder.of("result"), timeout=20)
        assert result["exit_code"] == 143  # rank 0's, not rank 1's 3
        assert result["cluster"]["kind"] == gang.kind
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_half_a_gang_goes_back_to_the_queue_and_its_workload_is_deleted(
    gang: Gang, cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, gang_seconds=0.5), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("half", gpus=8, nodes=2)
    name = pods.job_name("half", "lease-half")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        first, second = await asyncio.to_thread(gang.make_pods, kubelet, name)
        await asyncio.to_thread(kubelet.run, first)
        await asyncio.to_thread(
            kubelet.unschedulable, second, "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
        )
        (result,) = await until(lambda: recorder.of("result"), timeout=20)
        assert result["requeue"] is True
        assert "Insufficient nvidia.com/gpu" in result["reason"]
        assert await until(lambda: kubelet.gone(gang.kind, name))
        assert await until(lambda: not kubelet.pods_of(gang.group(name)))  # nothing of it holds GPUs
        await kube.stop_all(0)

    asyncio.run(scenario())
    pending = [body.get("reason", "") for body in recorder.of("status") if body["state"] == "pending"]
    assert any("1 of 2 pods placed" in reason for reason in pending)


def test_preempt_deletes_the_workload_orphaning_its_pods_then_them_with_the_grace_period(
    gang: Gang, cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("pre", gpus=2, nodes=2)
    name = pods.job_name("pre", "lease-pre")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        made = await asyncio.to_thread(gang.make_pods, kubelet, name, terminating=True)
        for pod in made:
            await asyncio.to_thread(kubelet.run, pod)
        await until(lambda: running_states(recorder) == 1)
        await kube.stop("pre", 9)
        deleted = cluster.requests("DELETE", rf"{gang.path}/{name}")
        assert [query.get("propagationPolicy") for _, _, query in deleted] == ["Orphan"]
        if gang.kind == "JobSet":  # and the Job its controller made, lest the Job controller replace pods
            job = gang.group(name)
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


def test_a_workload_deleted_outside_klique_ends_the_task_and_a_listing_lag_does_not(
    gang: Gang, cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("gone", gpus=2, nodes=2)
    name = pods.job_name("gone", "lease-gone")

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        await asyncio.to_thread(gang.delete, kubelet, name)
        kube.workloads.clear()  # listed at once, right after the create: not yet taken for gone
        for _ in range(5):
            await kube.look()
        assert not recorder.of("result")
        kube.created_at[name] = 0.0  # made long ago
        kube.workloads.clear()
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] is None
        said = f"{gang.kind} {name} was deleted outside Klique"
        assert any(said in line for line in recorder.lines())
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_restarted_agent_adopts_its_workload_and_one_it_never_recorded(
    gang: Gang, cluster: Cluster, tmp_path: Path
) -> None:
    """The workload's kind is kept in the agent's state; one made by an agent killed before it recorded
    it is found through its Job's or pods' labels. Neither is made twice, no line is read twice."""
    kubelet = Kubelet(cluster)
    recorded, unrecorded = assignment("rec", gpus=2, nodes=2), assignment("unrec", gpus=2, nodes=2)
    state_path = tmp_path / "agent.sqlite"

    async def before() -> None:
        kube = backend(cluster, tmp_path, State(state_path))
        recorder = Recorder(kube.state)
        for task in (recorded, unrecorded):
            begin(kube, task)
        await kube.start(recorded, recorder)
        assert await kube._multi_node() == gang.multi_node  # found by discovery
        chosen = dataclasses.replace(kube.settings.cluster, multi_node=gang.multi_node)
        manifests = pods.render(kube.settings.template_for(""), unrecorded, chosen, tenant="acme")
        await asyncio.to_thread(kube.api.create, manifests.secret)
        await asyncio.to_thread(kube.api.create, manifests.job)  # ... killed before add_job
        await kube.stop_all(0)

    asyncio.run(before())
    for task in ("rec", "unrec"):
        for pod in gang.make_pods(kubelet, pods.job_name(task, f"lease-{task}")):
            kubelet.run(pod)
            kubelet.write(pod, f"{task} {pod} up")

    async def after() -> Recorder:
        kube = backend(cluster, tmp_path, State(state_path))
        recorder = Recorder(kube.state)
        kube.adopt(recorder)
        await until(lambda: kube.running() == ["rec", "unrec"])
        assert {record.kind for record in kube.state.jobs()} == {gang.kind}
        await kube.start(recorded, recorder)  # assigned again: nothing is made twice
        await until(lambda: running_states(recorder) == 2)
        await until(lambda: len(recorder.lines()) == 4)
        for task in ("rec", "unrec"):
            name = pods.job_name(task, f"lease-{task}")
            for pod in kubelet.pods_of(gang.group(name)):
                await asyncio.to_thread(kubelet.end, pod["metadata"]["name"], 0)
            await asyncio.to_thread(gang.ended, kubelet, name, True)
        await until(lambda: len(recorder.of("result")) == 2, timeout=20)
        await kube.stop_all(0)
        return recorder

    recorder = asyncio.run(after())
    assert {body["exit_code"] for body in recorder.of("result")} == {0}
    assert len(recorder.lines()) == 4
    assert len(cluster.requests("POST", gang.path)) == 2


def test_kueue_admits_the_workload_as_one(gang: Gang, cluster: Cluster, tmp_path: Path) -> None:
    kube, kubelet = backend(cluster, tmp_path, local_queue="team-a"), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("kq", gpus=8, nodes=2)
    name = pods.job_name("kq", "lease-kq")
    said = "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu"

    async def scenario() -> None:
        begin(kube, task)
        await kube.start(task, recorder)
        made = await asyncio.to_thread(gang.read, kubelet, name)
        assert gang.suspended(made)
        assert made["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert "kueue.x-k8s.io/queue-name" not in str(made["spec"])  # only the workload is queued
        group, version, _ = pods.CUSTOM_WORKLOADS[gang.kind]
        workload = {
            "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
            "metadata": {"name": f"{gang.kind.lower()}-{name}", "namespace": NAMESPACE, "ownerReferences": [
                {"apiVersion": f"{group}/{version}", "kind": gang.kind, "name": name, "uid": "u"}]},
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
        await asyncio.to_thread(gang.admit, kubelet, name)
        for pod in await asyncio.to_thread(gang.make_pods, kubelet, name):
            await asyncio.to_thread(kubelet.run, pod)
        await until(lambda: running_states(recorder) == 1)
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_run_that_ended_is_not_adopted_again_while_its_result_waits_for_the_plane(
    gang: Gang, cluster: Cluster, tmp_path: Path
) -> None:
    """The workload and its pods stay until their TTL; a listing made before the plane answered the result
    (the watch listing again after a 410, the plane away) must not take the run up again: its result and
    its lines would go out twice."""
    kube, kubelet = backend(cluster, tmp_path), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = assignment("once", gpus=2, nodes=2)
    name = pods.job_name("once", "lease-once")

    async def scenario() -> list[str]:
        begin(kube, task)
        await kube.start(task, recorder)
        made = await asyncio.to_thread(gang.make_pods, kubelet, name)
        for pod in made:
            await asyncio.to_thread(kubelet.run, pod)
            await asyncio.to_thread(kubelet.write, pod, f"{pod} done")
            await asyncio.to_thread(kubelet.end, pod, 0)
        await asyncio.to_thread(gang.ended, kubelet, name, True)
        await until(lambda: recorder.of("result"), timeout=20)
        assert kube.running() == []
        for kind in ("Job", "Pod"):  # listed again, as after 410 Gone
            items, _ = await asyncio.to_thread(kube.api.listing, kind)
            kube._synced(kind, items)
        kube.workloads.clear()
        for _ in range(5):
            await kube.look()
        assert kube.running() == []
        await kube.stop_all(0)
        return made

    made = asyncio.run(scenario())
    assert len(recorder.of("result")) == 1
    assert sorted(recorder.lines()) == sorted(f"{pod} done" for pod in made)  # each line once


@pytest.mark.parametrize("gang", GANGS, ids=[gang.kind for gang in GANGS])
def test_a_kind_asked_for_that_the_cluster_does_not_serve_is_refused_saying_what_to_install(
    gang: Gang, tmp_path: Path
) -> None:
    bare = Cluster().start()  # neither JobSet nor the training operator
    try:
        kube = backend(bare, tmp_path, multi_node=gang.multi_node)
        task = assignment("absent", gpus=2, nodes=2)

        refused = refusal(kube, task)
        group, version, plural = pods.CUSTOM_WORKLOADS[gang.kind]
        product = "JobSet" if gang.kind == "JobSet" else "the Kubeflow training operator"
        assert "The multi-node workload was not created" in str(refused)
        assert f"does not serve {group}/{version} {plural}: install {product}" in str(refused)
        assert refused.permanent is False  # the task waits for it, or for another pool
        assert kube.state.jobs() == []
        assert Kubelet(bare).gone("Secret", pods.job_name("absent", "lease-absent"))  # nothing left behind
    finally:
        bare.stop()


def _ended_pod(rank: int, code: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"p-{rank}", "annotations": {kubernetes.INDEX_ANNOTATION: str(rank)}},
        "status": {"containerStatuses": [{"name": "main", "state": {"terminated": {"exitCode": code}}}]},
    }


@pytest.mark.parametrize(
    ("ended", "code"),
    [
        ([(1, 3), (0, 143)], 143),
        ([(0, 143), (1, 3)], 143),
        ([(2, 0), (1, 7), (3, 9)], 7),
        ([(1, 0), (0, 0)], 0),
    ],
)
def test_the_lowest_failing_rank_gives_the_exit_code_whatever_the_order_pods_are_listed(
    ended: list[tuple[int, int]], code: int
) -> None:
    seen = kubernetes._exit([_ended_pod(rank, exit_code) for rank, exit_code in ended])
    assert seen.exit_code == code
