"""A Kubernetes API for the tests: kmock's emulator on a real port, reached with the official client.

The emulator keeps objects, serves lists, watches, fetches, merge patches and deletes; it runs no
controllers. The tests stand in for them as a cluster would: `Kubelet` makes a Job's pods (the Job
controller's part), places and runs them, writes their logs and ends them (the kubelet's part), and sets
the Job's conditions; on a cluster with JobSet (`Cluster(jobset=True)`, which serves the CRD's API group),
`Kubelet.make_jobset_job` is the JobSet controller making a JobSet's Job; with the training operator
(`Cluster(pytorchjob=True)`), `Kubelet.make_pytorchjob_pods` is the operator making a PyTorchJob's pods
with its labels and rendezvous variables. Beyond the emulator, this module
serves Leases with the API server's optimistic concurrency (resource versions, 409 Conflict), serves pod
logs (with `timestamps` and `sinceTime`, as the kubelet does), takes `watch=True` as the API server does
(the emulator wants `true`), and can cut every open watch, answer the next watch with 410 Gone, or refuse
a request as RBAC would (403).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import attrs
import kmock
from kubernetes import client

NAMESPACE = "ml"
IMAGE = {"image": "python:3.11-slim", "imageID": "", "ready": True, "restartCount": 0}  # as a kubelet reports
KEPT_REQUESTS = 20
LOG_PATH = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<pod>[^/]+)/log")
LEASE_PATH = re.compile(r"/apis/coordination.k8s.io/v1/namespaces/(?P<ns>[^/]+)/leases(?:/(?P<name>[^/]+))?")


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    logs: dict[str, list[tuple[str, str]]] = attrs.field(factory=dict)  # pod -> (timestamp, line)
    watches: set[asyncio.Task[Any]] = attrs.field(factory=set)
    gone_next: int = 0  # how many next watches answer 410 Gone
    refused: list[tuple[str, re.Pattern[str]]] = attrs.field(factory=list)  # (method, path) -> 403
    seen: list[tuple[str, str, dict[str, str]]] = attrs.field(factory=list)  # (method, path, query)
    authorization: str = ""  # the last request's Authorization header
    leases: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # name -> Lease, served as below
    versions: int = 0

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.query.get("watch") in ("True", "1"):  # the official client sends True
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.update_query(watch="true"))
        self.seen.append((raw_request.method, raw_request.path, dict(raw_request.query)))
        self.authorization = raw_request.headers.get("Authorization", "")
        # kmock keeps every request it served and matches each new one by walking them all: trimmed to
        # the last few, so a long run (a benchmark, an end-to-end test) costs the same per request.
        if len(self._requests) > KEPT_REQUESTS:
            del self._requests[: len(self._requests) - KEPT_REQUESTS // 2]
        for method, path in self.refused:
            if raw_request.method == method and path.fullmatch(raw_request.path):
                return _status(
                    403,
                    "Forbidden",
                    f"{raw_request.path} is forbidden: User "
                    f'"system:serviceaccount:{NAMESPACE}:klique-agent" cannot {method.lower()} it',
                )
        lease = LEASE_PATH.fullmatch(raw_request.path)
        if lease:
            return await self._lease(raw_request, lease["name"] or "")
        log = LOG_PATH.fullmatch(raw_request.path)
        if log and raw_request.method == "GET":
            return self._log(log["pod"], raw_request.query)
        if raw_request.query.get("watch") == "true":
            if self.gone_next:
                self.gone_next -= 1
                gone = {
                    "type": "ERROR",
                    "object": {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "code": 410,
                        "reason": "Expired",
                        "message": "too old resource version",
                    },
                }
                return aiohttp.web.Response(
                    body=json.dumps(gone).encode() + b"\n", content_type="application/json"
                )
            task = asyncio.current_task()
            assert task is not None
            self.watches.add(task)
            try:
                return await super().__call__(raw_request)
            finally:
                self.watches.discard(task)
        return await super().__call__(raw_request)

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        """Each object created gets its uid, as the API server gives one (owner references name it)."""
        if request.resource is not None and request.action == kmock.action.CREATE:
            metadata = request.data.setdefault("metadata", {}) if isinstance(request.data, dict) else {}
            metadata.setdefault("uid", str(uuid.uuid4()))
        return await super()._handle(request)

    async def _lease(  # noqa: PLR0911 -- one answer per verb and refusal, as the API server's
        self, request: aiohttp.web.BaseRequest, name: str
    ) -> aiohttp.web.StreamResponse:
        """Leases as the API server keeps them, which the emulator does not: each write gets a new
        resourceVersion, and a write naming another version than the stored one is 409 Conflict."""
        if request.method == "GET":
            if name not in self.leases:
                return _status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
            return aiohttp.web.json_response(self.leases[name])
        body = await request.json()
        if request.method == "POST":
            name = str(body["metadata"]["name"])
            if name in self.leases:
                return _status(409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already exists')
            self.versions += 1
            body["metadata"]["resourceVersion"] = str(self.versions)
            self.leases[name] = body
            return aiohttp.web.json_response(body, status=201)
        if request.method == "PATCH":
            stored = self.leases.get(name)
            if stored is None:
                return _status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
            wanted = (body.get("metadata") or {}).get("resourceVersion")
            if wanted and wanted != stored["metadata"]["resourceVersion"]:
                return _status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": the object '
                    "has been modified; please apply your changes to the latest version and try again",
                )
            self.versions += 1
            stored["spec"] = {**stored.get("spec", {}), **(body.get("spec") or {})}
            stored["metadata"]["resourceVersion"] = str(self.versions)
            return aiohttp.web.json_response(stored)
        return _status(405, "MethodNotAllowed", f"{request.method} is not served for leases here")

    def _log(self, pod: str, query: Any) -> aiohttp.web.StreamResponse:
        if pod not in self.logs:
            return _status(404, "NotFound", f'pods "{pod}" not found')
        since = str(query.get("sinceTime") or "")
        stamped = query.get("timestamps") == "true"
        lines = [
            (f"{stamp} {line}" if stamped else line)
            for stamp, line in self.logs[pod]
            if not since or stamp[:19] >= since[:19]
        ]
        return aiohttp.web.Response(text="".join(f"{line}\n" for line in lines), content_type="text/plain")


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return aiohttp.web.json_response(body, status=code)


@dataclass
class Cluster:
    """The emulator serving on 127.0.0.1 in its own thread and event loop."""

    jobset: bool = False  # serve jobset.x-k8s.io/v1alpha2, as a cluster with JobSet installed does
    pytorchjob: bool = False  # serve kubeflow.org/v1 pytorchjobs, as one with the training operator does
    k3k: bool = False  # serve k3k.io/v1beta1 clusters, as one with K3k installed does
    emulator: Emulator | None = None
    url: str = ""
    loop: asyncio.AbstractEventLoop | None = None
    stopped: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Cluster:
        ready = threading.Event()

        async def serve() -> None:
            async with Emulator() as emulator, kmock.Server(emulator) as server:
                for resource in (
                    "batch/v1/jobs",
                    "v1/pods",
                    "v1/secrets",
                    "v1/services",
                    "v1/nodes",
                    "kueue.x-k8s.io/v1beta1/workloads",
                    *(["jobset.x-k8s.io/v1alpha2/jobsets"] if self.jobset else []),
                    *(["kubeflow.org/v1/pytorchjobs"] if self.pytorchjob else []),
                    *(["k3k.io/v1beta1/clusters"] if self.k3k else []),
                ):
                    emulator.resources[resource] = kmock.ResourceInfo()
                self.emulator, self.url, self.loop = (
                    emulator,
                    str(server.url).rstrip("/"),
                    asyncio.get_running_loop(),
                )
                ready.set()
                while not self.stopped.is_set():
                    await asyncio.sleep(0.05)

        self.thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
        self.thread.start()
        assert ready.wait(20), "the emulator did not start"
        return self

    def stop(self) -> None:
        """Stop serving and wait for it: kmock's client hooks are process-wide, one server at a time."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(20)

    def call(self, function: Any) -> Any:
        """Run `function()` in the emulator's loop (its state is the loop's alone)."""
        assert self.loop is not None

        async def inside() -> Any:
            return function()

        return asyncio.run_coroutine_threadsafe(inside(), self.loop).result(10)

    def cut_watches(self) -> int:
        """Drop every open watch, as a load balancer or an API server restart does."""
        assert self.emulator is not None
        emulator = self.emulator
        return int(self.call([task.cancel() for task in list(emulator.watches)].__len__))

    def requests(self, method: str, pattern: str) -> list[tuple[str, str, dict[str, str]]]:
        assert self.emulator is not None
        return [
            item for item in list(self.emulator.seen) if item[0] == method and re.fullmatch(pattern, item[1])
        ]

    def api(self) -> client.ApiClient:
        configuration = client.Configuration()
        configuration.host = self.url
        return client.ApiClient(configuration)


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


class Kubelet:
    """What a cluster's controllers and kubelets do to Klique's objects, through the API."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        api = cluster.api()
        self.batch, self.core = client.BatchV1Api(api), client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def jobs(self) -> list[dict[str, Any]]:
        data = json.loads(self.batch.list_namespaced_job(NAMESPACE, _preload_content=False).data)
        return list(data.get("items") or [])

    def job(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.batch.read_namespaced_job(name, NAMESPACE, _preload_content=False).data))

    def jobset(self, name: str) -> dict[str, Any]:
        return dict(
            json.loads(
                self.custom.get_namespaced_custom_object(
                    "jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets", name, _preload_content=False
                ).data
            )
        )

    def make_jobset_job(self, jobset_name: str) -> str:
        """The JobSet controller: the Job of the JobSet's one replicated Job, `<jobset>-<replicated>-0`, with
        the template's labels and the JobSet's own on the Job and its pod template, owned by the JobSet,
        suspended while the JobSet is."""
        jobset = self.jobset(jobset_name)
        replicated = jobset["spec"]["replicatedJobs"][0]
        name = f"{jobset_name}-{replicated['name']}-0"
        ours = {
            "jobset.sigs.k8s.io/jobset-name": jobset_name,
            "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
            "jobset.sigs.k8s.io/job-index": "0",
        }
        template = json.loads(json.dumps(replicated["template"]))
        pod_template = template["spec"]["template"]
        pod_template["metadata"]["labels"] = {**pod_template["metadata"].get("labels", {}), **ours}
        pod_template["spec"]["hostname"] = name  # the controller names each pod <job>-<index> by index
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "labels": {**template["metadata"].get("labels", {}), **ours},
                "annotations": template["metadata"].get("annotations", {}),
                "ownerReferences": [
                    {
                        "apiVersion": "jobset.x-k8s.io/v1alpha2",
                        "kind": "JobSet",
                        "name": jobset_name,
                        "uid": jobset["metadata"].get("uid", ""),
                        "controller": True,
                    }
                ],
            },
            "spec": {**template["spec"], "suspend": bool(jobset["spec"].get("suspend"))},
        }
        self.batch.create_namespaced_job(NAMESPACE, job, _preload_content=False)
        return name

    def pytorchjob(self, name: str) -> dict[str, Any]:
        return dict(
            json.loads(
                self.custom.get_namespaced_custom_object(
                    "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name, _preload_content=False
                ).data
            )
        )

    def make_pytorchjob_pods(self, name: str, *, terminating: bool = False) -> list[str]:
        """The training operator: a pod per replica, `<job>-master-0` and `<job>-worker-<i>`, with the
        template's labels and the operator's, and the rendezvous variables in the `pytorch` container.
        `terminating` as for make_pods."""
        job = self.pytorchjob(name)
        replicas = job["spec"]["pytorchReplicaSpecs"]
        world = sum(int(spec["replicas"]) for spec in replicas.values())
        names, rank = [], 0
        for role in ("Master", "Worker"):
            for index in range(int(replicas[role]["replicas"])):
                template = json.loads(json.dumps(replicas[role]["template"]))
                pod_name = f"{name}-{role.lower()}-{index}"
                labels = {
                    **template["metadata"].get("labels", {}),
                    "training.kubeflow.org/job-name": name,
                    "training.kubeflow.org/operator-name": "pytorchjob-controller",
                    "training.kubeflow.org/replica-type": role.lower(),
                    "training.kubeflow.org/replica-index": str(index),
                    **({"training.kubeflow.org/job-role": "master"} if role == "Master" else {}),
                }
                for container in template["spec"]["containers"]:
                    if container["name"] == "pytorch":
                        container["env"] = [
                            *container.get("env", []),
                            {"name": "MASTER_PORT", "value": "23456"},
                            {"name": "MASTER_ADDR", "value": f"{name}-master-0"},
                            {"name": "WORLD_SIZE", "value": str(world)},
                            {"name": "RANK", "value": str(rank)},
                        ]
                pod = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": pod_name,
                        "namespace": NAMESPACE,
                        "labels": labels,
                        "annotations": template["metadata"].get("annotations", {}),
                        "ownerReferences": [
                            {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": name, "uid": "u"}
                        ],
                        "finalizers": ["tests.klique.io/kubelet"] if terminating else [],
                    },
                    "spec": template["spec"],
                    "status": {"phase": "Pending"},
                }
                self.core.create_namespaced_pod(NAMESPACE, pod, _preload_content=False)
                names.append(pod_name)
                rank += 1
        return names

    def pytorchjob_ended(self, name: str, ok: bool) -> None:
        condition = (
            {"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded", "message": "succeeded"}
            if ok
            else {
                "type": "Failed",
                "status": "True",
                "reason": "PyTorchJobFailed",
                "message": "a replica failed",
            }
        )
        self.custom.patch_namespaced_custom_object(
            "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name,
            {"status": {"conditions": [condition]}}, _preload_content=False,
        )  # fmt: skip

    def jobset_ended(self, name: str, ok: bool) -> None:
        condition = (
            {
                "type": "Completed",
                "status": "True",
                "reason": "AllJobsCompleted",
                "message": "jobset completed",
            }
            if ok
            else {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "jobset failed"}
        )
        self.custom.patch_namespaced_custom_object(
            "jobset.x-k8s.io",
            "v1alpha2",
            NAMESPACE,
            "jobsets",
            name,
            {"status": {"conditions": [condition]}},
            _preload_content=False,
        )

    def delete_jobset(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets", name, _preload_content=False
        )

    def k3k_cluster(self, name: str) -> dict[str, Any]:
        read = self.custom.get_namespaced_custom_object
        return dict(
            json.loads(read("k3k.io", "v1beta1", NAMESPACE, "clusters", name, _preload_content=False).data)
        )

    def k3k_phase(self, name: str, phase: str, message: str = "") -> None:
        """The K3k controller's status of a Cluster: its phase, and a condition that says what is wrong."""
        status: dict[str, Any] = {"phase": phase}
        if message:
            status["conditions"] = [
                {"type": "Ready", "status": "False", "reason": "ServerFailed", "message": message}
            ]
        self.custom.patch_namespaced_custom_object(
            "k3k.io", "v1beta1", NAMESPACE, "clusters", name, {"status": status}, _preload_content=False
        )

    def k3k_bootstrap(self, name: str, content: dict[str, Any]) -> None:
        """The K3k controller's bootstrap Secret of a Cluster: its certificate authorities, JSON under
        `bootstrap`, base64 in `data` as an API server gives it."""
        import base64

        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"k3k-{name}-bootstrap", "namespace": NAMESPACE},
            "data": {"bootstrap": base64.b64encode(json.dumps(content).encode()).decode()},
        }
        self.core.create_namespaced_secret(NAMESPACE, secret, _preload_content=False)

    def delete_k3k(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(
            "k3k.io", "v1beta1", NAMESPACE, "clusters", name, _preload_content=False
        )

    def network_policy(self, name: str) -> dict[str, Any]:
        networking = client.NetworkingV1Api(self.core.api_client)
        read = networking.read_namespaced_network_policy(name, NAMESPACE, _preload_content=False)
        return dict(json.loads(read.data))

    def service(self, name: str) -> dict[str, Any]:
        return dict(
            json.loads(self.core.read_namespaced_service(name, NAMESPACE, _preload_content=False).data)
        )

    def secret(self, name: str) -> dict[str, Any]:
        return dict(
            json.loads(self.core.read_namespaced_secret(name, NAMESPACE, _preload_content=False).data)
        )

    def pods_of(self, job: str) -> list[dict[str, Any]]:
        """The pods of a Job, or of a PyTorchJob (by the operator's label)."""
        data = json.loads(self.core.list_namespaced_pod(NAMESPACE, _preload_content=False).data)
        return [
            pod
            for pod in data.get("items") or []
            if job
            in (
                pod["metadata"]["labels"].get("job-name"),
                pod["metadata"]["labels"].get("training.kubeflow.org/job-name"),
            )
        ]

    def make_pods(self, job_name: str, *, terminating: bool = False) -> list[str]:
        """The Job controller: one pod per completion index, with the template's labels and the job's.
        `terminating`: a deleted pod stays (Terminating) until `terminated` says its kubelet stopped it,
        as a real pod does for its grace period."""
        job = self.job(job_name)
        spec = job["spec"]
        template = spec["template"]
        names = []
        for index in range(int(spec.get("completions") or 1)):
            name = f"{job_name}-{index}-x{index}"
            labels = {
                **template["metadata"]["labels"],
                "job-name": job_name,
                "batch.kubernetes.io/job-name": job_name,
                "batch.kubernetes.io/job-completion-index": str(index),
            }
            annotations = {
                **template["metadata"].get("annotations", {}),
                "batch.kubernetes.io/job-completion-index": str(index),
            }
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": NAMESPACE,
                    "labels": labels,
                    "annotations": annotations,
                    "finalizers": ["tests.klique.io/kubelet"] if terminating else [],
                },
                "spec": template["spec"],
                "status": {"phase": "Pending"},
            }
            self.core.create_namespaced_pod(NAMESPACE, pod, _preload_content=False)
            names.append(name)
        return names

    def patch_pod(self, name: str, status: dict[str, Any], spec: dict[str, Any] | None = None) -> None:
        body: dict[str, Any] = {"status": status}
        if spec:
            body["spec"] = spec
        self.core.patch_namespaced_pod(name, NAMESPACE, body, _preload_content=False)

    def unschedulable(self, name: str, message: str) -> None:
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        self.patch_pod(name, {"phase": "Pending", "conditions": [condition]})

    def run(self, name: str, node: str = "gpu-node-1", ip: str = "") -> None:
        status: dict[str, Any] = {
            "phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "main", "state": {"running": {"startedAt": now()}}, **IMAGE}],
        }
        if ip:
            status["podIP"] = ip
        self.patch_pod(name, status, {"nodeName": node})
        assert self.cluster.emulator is not None
        emulator = self.cluster.emulator
        self.cluster.call(lambda: emulator.logs.setdefault(name, []))

    def wait_image(self, name: str, reason: str, message: str) -> None:
        self.patch_pod(
            name,
            {
                "phase": "Pending",
                "containerStatuses": [
                    {"name": "main", "state": {"waiting": {"reason": reason, "message": message}}, **IMAGE}
                ],
            },
        )

    def write(self, name: str, *lines: str) -> None:
        assert self.cluster.emulator is not None
        emulator = self.cluster.emulator
        self.cluster.call(lambda: emulator.logs.setdefault(name, []).extend((now(), line) for line in lines))

    def end(self, name: str, code: int, reason: str = "") -> None:
        terminated: dict[str, Any] = {"exitCode": code, "finishedAt": now()}
        if reason:
            terminated["reason"] = reason
        self.patch_pod(
            name,
            {
                "phase": "Succeeded" if code == 0 else "Failed",
                "containerStatuses": [{"name": "main", "state": {"terminated": terminated}, **IMAGE}],
            },
        )

    def job_ended(self, name: str, ok: bool, reason: str = "BackoffLimitExceeded") -> None:
        condition = (
            {"type": "Complete", "status": "True"}
            if ok
            else {
                "type": "Failed",
                "status": "True",
                "reason": reason,
                "message": "Job has reached the specified backoff limit",
            }
        )
        self.batch.patch_namespaced_job(
            name, NAMESPACE, {"status": {"conditions": [condition]}}, _preload_content=False
        )

    def terminated(self, name: str, code: int = 143) -> None:
        """The kubelet stopped a Terminating pod's container (SIGTERM honoured): it goes."""
        self.end(name, code)
        self.core.patch_namespaced_pod(
            name, NAMESPACE, {"metadata": {"finalizers": []}}, _preload_content=False
        )

    def gone(self, kind: str, name: str) -> bool:
        if kind in ("JobSet", "PyTorchJob", "Cluster"):
            try:
                {"JobSet": self.jobset, "PyTorchJob": self.pytorchjob, "Cluster": self.k3k_cluster}[kind](
                    name
                )
            except client.exceptions.ApiException as error:
                return bool(error.status == 404)
            return False
        call = {
            "Job": self.batch.read_namespaced_job,
            "Secret": self.core.read_namespaced_secret,
            "Service": self.core.read_namespaced_service,
            "NetworkPolicy": client.NetworkingV1Api(self.core.api_client).read_namespaced_network_policy,
        }[kind]
        try:
            call(name, NAMESPACE, _preload_content=False)
        except client.exceptions.ApiException as error:
            return bool(error.status == 404)
        return False


def names(items: list[dict[str, Any]]) -> Iterator[str]:
    return (item["metadata"]["name"] for item in items)
