"""The Kubernetes backend: each task becomes a `batch/v1` Job in the agent's namespace, which the cluster's
own scheduler (kube-scheduler, Kueue, Volcano, KAI) places.

The agent renders the compute resource's pod template (protocol.pods) into the Job, a Secret that holds
the task's environment and secrets (the pod takes them with `envFrom`; they are never values in the pod
spec), and for a multi-node task a headless Service its pods meet through. It follows its objects with one
watch of Jobs and one of Pods, labelled `klique.io/agent=<agent>`, resumed from the last resource version
after a drop and listed again on `410 Gone`; what it sees is reduced to the task's state (waiting with the
cluster's reason, running, ended with the exit code) and reported only when it changes. Each pod's log is
read with its timestamps and sent home through the outbox with a cursor that moves in the same SQLite
transaction, so after a crash nothing is sent twice or skipped. A restarted agent adopts the Jobs it
labelled instead of creating them again.

A multi-node task is gang-placed: until every pod of its Job runs, the task waits; when some pods run and
others cannot be placed for `gang_seconds`, the Job is deleted and the task goes back to Klique's queue,
so half a job never holds GPUs. Preemption deletes the pods with the stop's grace period (the kubelet
sends SIGTERM, waits, then SIGKILL); an abort deletes them at once.

The official `kubernetes` client is synchronous: every call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agents import k3k
from agents.backend import Refused, Report, Upload, free_port, upload_outputs, with_log_end
from agents.baremetal import split_lines
from agents.leadership import Conflict, Leadership
from agents.relay import NodeRelay, new_key
from agents.state import JobRecord, LogCursor, State
from protocol import apps as protocol_apps
from protocol import clusters, pods
from protocol import environment as task_environment
from protocol import volumes as task_volumes

logger = logging.getLogger("klique.agent.kubernetes")

T = TypeVar("T")

# What groups a task's pods: their Job's name, or the training operator's name for its PyTorchJob.
TRAINING_JOB_LABEL = "training.kubeflow.org/job-name"
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name", TRAINING_JOB_LABEL)
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # on a JobSet's Jobs and pods
REPLICA_TYPE_LABEL, REPLICA_INDEX_LABEL = (
    "training.kubeflow.org/replica-type",
    "training.kubeflow.org/replica-index",
)
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# Waiting reasons of a container that no wait will cure: the task fails at once, saying why.
HOPELESS = frozenset({"InvalidImageName", "ErrImageNeverPull"})
# Waiting reasons that may pass (a registry down, a tag pushed late): the task fails after image_pull_seconds.
IMAGE_PULL = frozenset({"ErrImagePull", "ImagePullBackOff", "RegistryUnavailable"})
ADMISSION_SECONDS = 5.0  # how often Kueue's Workloads are read while a Job waits for admission
# The custom objects the agent makes, by kind: its workloads, and the clusters of clustering services.
CUSTOM_OBJECTS = {
    **pods.CUSTOM_WORKLOADS,
    clusters.K3K_KIND: (clusters.K3K_GROUP, clusters.K3K_VERSION, clusters.K3K_PLURAL),
}
CLUSTER_READ_SECONDS = 2.0  # how often the clusters of clustering services are listed while one runs
CLUSTER_SWEEP_SECONDS = 60.0  # how often, while none runs, they are listed for clusters of no run
CLUSTER_ORPHAN_SECONDS = 60.0  # how long a cluster of no run is left (a start under way) before it goes
WORKLOAD_READ_SECONDS = 2.0  # how often the JobSets (while one's Job is not seen) and PyTorchJobs are listed
DISCOVERY_SECONDS = 300.0  # how long the answer "which workload APIs does the cluster serve" is kept
LEASE_WRITE_SECONDS = 10.0  # how long a start waits for the run's lease to be on disk before it refuses
APP_LOOK_SECONDS = 1.0  # how often the agent looks whether an app's pod runs
LOG_TAIL_LINES = 3  # the last lines of a run's log kept for the reason of an app stopped from outside
GPU_RESOURCE = re.compile(r"nvidia\.com/gpu|nvidia\.com/gpu\.shared|nvidia\.com/mig-[a-z0-9.+]+|amd\.com/gpu")


@dataclass
class KubeSettings:
    """The `[agent.kubernetes]` table of the agent's configuration."""

    cluster: pods.ClusterSettings
    templates: dict[str, pods.Template]  # by compute resource; "default" for every other
    kubeconfig: str = ""  # a kubeconfig file; "" for the pod's service account, else ~/.kube/config
    context: str = ""
    api_url: str = ""  # an API server to reach without credentials (a local proxy, `kubectl proxy`)
    outputs_dir: Path | None = None  # where the agent mounts the work volume: outputs are read there
    poll_seconds: float = 1.0  # how often running pods' logs are read
    gang_seconds: float = 120.0
    image_pull_seconds: float = 300.0
    watch_seconds: int = 300  # each watch's server-side timeout; the watch resumes after it
    leader_election: bool = False  # act only while holding the Lease `lease_name` (agents.leadership)
    lease_name: str = ""
    lease_seconds: int = 15
    multi_node: str = "auto"  # one of pods.MULTI_NODE_KINDS, or "auto": JobSet, else PyTorchJob, where served
    relay_image: str = ""  # the image an app's relay runs from (the agent's own); "" serves no apps

    @classmethod
    def read(cls, config: Mapping[str, Any], agent_id: str) -> KubeSettings:
        """The settings from the agent's TOML; every pod template is parsed and its manifests checked
        against the Kubernetes schema. Raises ValueError (PodTemplateInvalid names the template and line)."""
        table = dict((config.get("agent") or {}).get("kubernetes") or {})
        known = {
            "namespace",
            "kubeconfig",
            "context",
            "api_url",
            "templates",
            "local_queue",
            "gpu_resource",
            "shared_gpu_resource",
            "ttl_seconds_after_finished",
            "default_image",
            "shared_path",
            "shared_volume",
            "work_volume",
            "outputs_dir",
            "scratch_size",
            "poll_seconds",
            "gang_seconds",
            "image_pull_seconds",
            "watch_seconds",
            "volumes",
            "leader_election",
            "lease_name",
            "lease_seconds",
            "multi_node",
            "relay_image",
            "app_network_policy",
        }
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"[agent.kubernetes] has unknown settings: {', '.join(unknown)}.")
        multi_node = str(table.get("multi_node") or "auto")
        if multi_node not in ("auto", *pods.MULTI_NODE_KINDS):
            raise ValueError(
                f"[agent.kubernetes] multi_node is one of auto, {', '.join(pods.MULTI_NODE_KINDS)}, "
                f"not {multi_node!r}."
            )
        cluster = pods.ClusterSettings(
            namespace=str(table.get("namespace") or "default"),
            agent=agent_id,
            gpu_resource=str(table.get("gpu_resource") or "nvidia.com/gpu"),
            shared_gpu_resource=str(table.get("shared_gpu_resource") or "nvidia.com/gpu.shared"),
            local_queue=str(table.get("local_queue") or ""),
            ttl_seconds_after_finished=int(table.get("ttl_seconds_after_finished", 3600)),
            default_image=str(table.get("default_image") or "python:3.11-slim"),
            shared_path=str(table.get("shared_path") or ""),
            shared_volume=dict(table.get("shared_volume") or {}),
            work_volume=dict(table.get("work_volume") or {}),
            scratch_size=str(table.get("scratch_size") or ""),
            volumes=_offered_volumes(table),
            app_network_policy=_boolean(table, "app_network_policy", default=True),
        )
        texts = {
            "default": pods.DEFAULT_TEMPLATE,
            **{str(k): str(v) for k, v in (table.get("templates") or {}).items()},
        }
        templates = {name: pods.check(name, text, cluster) for name, text in texts.items()}
        outputs = table.get("outputs_dir")
        return cls(
            cluster=cluster,
            templates=templates,
            kubeconfig=str(table.get("kubeconfig") or ""),
            context=str(table.get("context") or ""),
            api_url=str(table.get("api_url") or ""),
            outputs_dir=Path(outputs) if outputs else None,
            poll_seconds=float(table.get("poll_seconds", 1.0)),
            gang_seconds=float(table.get("gang_seconds", 120.0)),
            image_pull_seconds=float(table.get("image_pull_seconds", 300.0)),
            watch_seconds=int(table.get("watch_seconds", 300)),
            leader_election=_boolean(table, "leader_election"),
            lease_name=str(table.get("lease_name") or _lease_name(agent_id)),
            lease_seconds=int(table.get("lease_seconds", 15)),
            multi_node=multi_node,
            relay_image=str(table.get("relay_image") or ""),
        )

    def template_for(self, compute_resource: str) -> pods.Template:
        return self.templates.get(compute_resource) or self.templates["default"]

    def leadership(self, api: Api, identity: str) -> Leadership:
        """Client-go's proportions: renew deadline two thirds of the Lease, retries every seventh."""
        seconds = self.lease_seconds
        if seconds < 3:
            raise ValueError(f"lease_seconds is at least 3, not {seconds}.")
        return Leadership(
            api,
            self.lease_name,
            self.cluster.namespace,
            identity,
            lease_seconds=seconds,
            renew_deadline_seconds=seconds * 2 / 3,
            retry_seconds=seconds / 7.5,
        )


def _lease_name(agent_id: str) -> str:
    """A DNS subdomain: the Lease's name."""
    return f"klique-agent-{re.sub(r'[^a-z0-9.-]+', '-', agent_id.lower()).strip('-.') or 'agent'}"[:253]


def _boolean(table: Mapping[str, Any], key: str, *, default: bool = False) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise TypeError(f"[agent.kubernetes] {key} must be true or false, not {value!r}.")
    return value


def _offered_volumes(table: Mapping[str, Any]) -> dict[str, task_volumes.Offered]:
    """The `[agent.kubernetes.volumes]` a task may declare; none at the shared file system's path."""
    offers = task_volumes.offered(dict(table.get("volumes") or {}))
    shared = str(table.get("shared_path") or "")
    for offer in offers.values():
        if shared and (offer.path == shared or offer.path.startswith(f"{shared.rstrip('/')}/")):
            raise ValueError(f"volumes.{offer.name}: {offer.path} is the shared file system's path.")
    return offers


# The API -------------------------------------------------------------------------------------------------


class ApiProblem(Exception):
    """The API server refused or could not be reached; the message says what an administrator can do."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

    @property
    def permanent(self) -> bool:
        return self.status in (400, 422)  # the object itself is wrong: sending it again fails again


def explain(error: BaseException, verb: str, resource: str, namespace: str, where: str) -> ApiProblem:
    """An API error in words an administrator can act on."""
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415 -- the kubernetes extra

    if isinstance(error, ApiException):
        status = int(error.status or 0)
        said = _status_message(error)
        if status == 401:
            return ApiProblem(
                f"the Kubernetes API at {where} refused the agent's credentials (401 Unauthorized): "
                "give it a valid kubeconfig or service-account token",
                status=status,
            )
        if status == 403:
            return ApiProblem(
                f"the agent's service account may not {verb} {resource} in namespace {namespace}: apply the "
                f"chart's Role (deploy/helm/klique-agent) or grant it. Kubernetes said: {said}",
                status=status,
            )
        if status == 404 and resource != "pods/log":
            return ApiProblem(
                f"namespace {namespace} or the {resource} API is not found at {where}: create the namespace "
                f"or name another in [agent.kubernetes]. Kubernetes said: {said}",
                status=status,
            )
        return ApiProblem(
            f"Kubernetes refused to {verb} {resource} in namespace {namespace} ({status}): {said}",
            status=status,
        )
    return ApiProblem(f"the Kubernetes API at {where} cannot be reached ({type(error).__name__}: {error})")


def _status_message(error: Any) -> str:
    try:
        body = json.loads(error.body or "{}")
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return str(message or error.reason or "no reason given")[:500]


def credentials(settings: KubeSettings) -> Any:
    """The client's configuration: `api_url` as it is (a local proxy that adds credentials itself); else
    the `kubeconfig` file (its `context`, or its current one); else the pod's service account, whose
    token the client reads again as the kubelet rotates it; else $KUBECONFIG or ~/.kube/config. Raises
    ValueError saying what was looked for and what to set."""
    import yaml  # noqa: PLC0415 -- the client's own dependency

    from kubernetes import client, config  # noqa: PLC0415

    configuration = client.Configuration()
    if settings.api_url:
        configuration.host = settings.api_url.rstrip("/")
        return configuration
    context = settings.context or None
    if settings.kubeconfig:
        try:
            config.load_kube_config(settings.kubeconfig, context, configuration)
        except (config.ConfigException, OSError, yaml.YAMLError) as error:
            raise ValueError(
                f"the kubeconfig {settings.kubeconfig} cannot be used"
                f"{f' with context {context!r}' if context else ''}: {error}"
            ) from None
        return _bearer_under_both_names(configuration)
    try:
        config.load_incluster_config(configuration)
        return _bearer_under_both_names(configuration)
    except config.ConfigException as in_pod:
        not_in_pod = str(in_pod)
    fallback = os.environ.get("KUBECONFIG") or "~/.kube/config"  # read now: the client reads it at import
    try:
        config.load_kube_config(os.path.expanduser(fallback), context, configuration)
    except (config.ConfigException, OSError, yaml.YAMLError) as error:
        raise ValueError(
            f"no credentials found: not in a pod with a service account ({not_in_pod}), and no usable "
            f"kubeconfig at $KUBECONFIG or ~/.kube/config ({error}). Set kubeconfig (and context) or "
            "api_url in [agent.kubernetes], or run the agent with the klique-agent chart."
        ) from None
    return _bearer_under_both_names(configuration)


def _bearer_under_both_names(configuration: Any) -> Any:
    """The loaders put a bearer token under api_key["authorization"]; client 36 sends only what is under
    api_key["BearerToken"] (kubernetes-client/python#2582), so every request would go out anonymous.
    The token is kept under both, after each refresh too (a service account's rotated token, an exec
    plugin's), so that any client version in the extra's range sends it."""
    names, last = ("authorization", "BearerToken"), [""]
    refresh = [configuration.refresh_api_key_hook]

    def mirror(target: Any) -> None:
        if refresh[0] is not None:
            refresh[0](target)
            if target.refresh_api_key_hook is not mirror:  # a loader sets its hook again as it refreshes
                refresh[0], target.refresh_api_key_hook = target.refresh_api_key_hook, mirror
        held = [str(target.api_key.get(name) or "") for name in names]
        token = next((t for t in held if t and t != last[0]), "") or next((t for t in held if t), "")
        if token:  # the one a refresh changed, whichever name the loader writes
            target.api_key["authorization"] = target.api_key["BearerToken"] = last[0] = token

    mirror(configuration)
    if refresh[0] is not None:
        configuration.refresh_api_key_hook = mirror
    return configuration


class Api:
    """The few calls the backend makes, through the official client; each is synchronous."""

    def __init__(self, settings: KubeSettings) -> None:
        from kubernetes import client  # noqa: PLC0415 -- the kubernetes extra, this backend only

        configuration = credentials(settings)
        self.where = configuration.host
        self.client = client.ApiClient(configuration)
        self.batch = client.BatchV1Api(self.client)
        self.core = client.CoreV1Api(self.client)
        self.coordination = client.CoordinationV1Api(self.client)
        self.networking = client.NetworkingV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)
        self.namespace = settings.cluster.namespace
        self.selector = f"klique.io/agent={pods.label_value(settings.cluster.agent)}"

    def _raw(self, response: Any) -> dict[str, Any]:
        data = json.loads(response.data or b"{}")
        return data if isinstance(data, dict) else {}

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        kind, ns = manifest["kind"], self.namespace
        if kind in CUSTOM_OBJECTS:
            group, version, plural = CUSTOM_OBJECTS[kind]
            return self._raw(
                self.custom.create_namespaced_custom_object(
                    group, version, ns, plural, dict(manifest), _preload_content=False, _request_timeout=30
                )
            )
        create = {
            "Job": self.batch.create_namespaced_job,
            "Secret": self.core.create_namespaced_secret,
            "Service": self.core.create_namespaced_service,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
        }[kind]
        return self._raw(create(ns, dict(manifest), _preload_content=False, _request_timeout=30))

    def secret_value(self, name: str, key: str) -> str:
        """One value of a Secret (an API server gives them base64 in `data`)."""
        import base64  # noqa: PLC0415

        read = self.core.read_namespaced_secret
        secret = self._raw(read(name, self.namespace, _preload_content=False, _request_timeout=30))
        encoded = (secret.get("data") or {}).get(key)
        if encoded is not None:
            return base64.b64decode(str(encoded)).decode()
        return str((secret.get("stringData") or {}).get(key) or "")  # as written, where not encoded

    def refresh_secret(self, manifest: Mapping[str, Any]) -> None:
        """Write the run's values into its Secret that exists already (an assignment repeated): a merge
        patch of them, as `kubectl apply` would."""
        name = manifest["metadata"]["name"]
        body = {"stringData": dict(manifest.get("stringData") or {})}
        self.core.patch_namespaced_secret(
            name, self.namespace, body, _preload_content=False, _request_timeout=30
        )

    def serves(self, group_version: str, plural: str) -> bool:
        """Whether the API server serves the resource (its CRD is installed): API discovery, which every
        authenticated client may read."""
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        try:
            response = self.client.call_api(
                f"/apis/{group_version}",
                "GET",
                header_params={"Accept": "application/json"},
                response_types_map={},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=30,
                _return_http_data_only=True,
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        resources = self._raw(response).get("resources") or []
        return any(item.get("name") == plural for item in resources if isinstance(item, dict))

    def custom_workloads(self, kind: str) -> dict[str, dict[str, Any]]:
        """This agent's JobSets, PyTorchJobs or K3k Clusters (CUSTOM_OBJECTS), by name."""
        group, version, plural = CUSTOM_OBJECTS[kind]
        data = self._raw(
            self.custom.list_namespaced_custom_object(
                group,
                version,
                self.namespace,
                plural,
                label_selector=self.selector,
                _preload_content=False,
                _request_timeout=60,
            )
        )
        return {_name(item): item for item in data.get("items") or [] if _ours(item, self.selector)}

    def own(self, kind: str, name: str, job: Mapping[str, Any]) -> None:
        """Make the workload (the Job, JobSet or PyTorchJob) the owner of its Secret or Service, so
        Kubernetes deletes them with it."""
        uid = (job.get("metadata") or {}).get("uid")
        if not uid:
            return
        owner = {
            "apiVersion": str(job.get("apiVersion") or "batch/v1"),
            "kind": str(job.get("kind") or "Job"),
            "name": job["metadata"]["name"],
            "uid": uid,
            "blockOwnerDeletion": False,
        }
        patch = {"metadata": {"ownerReferences": [owner]}}
        if kind in CUSTOM_OBJECTS:
            group, version, plural = CUSTOM_OBJECTS[kind]
            self.custom.patch_namespaced_custom_object(
                group, version, self.namespace, plural, name, patch, _preload_content=False
            )
            return
        call = {
            "Secret": self.core.patch_namespaced_secret,
            "Service": self.core.patch_namespaced_service,
            "NetworkPolicy": self.networking.patch_namespaced_network_policy,
        }[kind]
        call(name, self.namespace, patch, _preload_content=False)

    def delete(
        self, kind: str, name: str, *, grace: int | None = None, propagation: str = "Background"
    ) -> None:
        """Delete the object; one already gone is no error."""
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        call: Callable[..., Any] = (
            self._delete_custom(kind)
            if kind in CUSTOM_OBJECTS
            else {
                "Job": self.batch.delete_namespaced_job,
                "Pod": self.core.delete_namespaced_pod,
                "Secret": self.core.delete_namespaced_secret,
                "Service": self.core.delete_namespaced_service,
                "NetworkPolicy": self.networking.delete_namespaced_network_policy,
            }[kind]
        )
        options: dict[str, Any] = {"propagation_policy": propagation}
        if grace is not None:
            options["grace_period_seconds"] = grace
        try:
            call(name, self.namespace, _preload_content=False, _request_timeout=30, **options)
        except ApiException as error:
            if error.status != 404:
                raise

    def _delete_custom(self, kind: str) -> Callable[..., Any]:
        group, version, plural = CUSTOM_OBJECTS[kind]

        def delete(name: str, namespace: str, **options: Any) -> Any:
            return self.custom.delete_namespaced_custom_object(
                group, version, namespace, plural, name, **options
            )

        return delete

    def listing(self, kind: str) -> tuple[list[dict[str, Any]], str]:
        """Klique's Jobs or Pods of this agent, and the resource version to watch from."""
        call = self.batch.list_namespaced_job if kind == "Job" else self.core.list_namespaced_pod
        data = self._raw(
            call(self.namespace, label_selector=self.selector, _preload_content=False, _request_timeout=60)
        )
        items = [item for item in data.get("items") or [] if _ours(item, self.selector)]
        return items, str((data.get("metadata") or {}).get("resourceVersion") or "")

    def watch(
        self, kind: str, version: str, seconds: int, stopper: list[Any], closing: threading.Event
    ) -> Iterable[tuple[str, dict[str, Any]]]:
        """Events (type, object) of Klique's Jobs or Pods from the resource version, as plain JSON (no
        models: a field the client does not know must not stop the watch); ends when the server closes
        it, or at once where `closing` was set while it was being opened (the response is in `stopper`
        from then on, for whoever sets `closing` to shut). Raises ApiException(410) when the version is
        too old to watch from."""
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415
        from kubernetes.watch.watch import iter_resp_lines  # noqa: PLC0415

        call = self.batch.list_namespaced_job if kind == "Job" else self.core.list_namespaced_pod
        options: dict[str, Any] = {
            "label_selector": self.selector,
            "timeout_seconds": seconds,
            "watch": True,
            "allow_watch_bookmarks": True,
            "_preload_content": False,
            "_request_timeout": seconds + 30,
        }
        if version:
            options["resource_version"] = version
        response = call(self.namespace, **options)
        stopper[:] = [response]
        try:
            if closing.is_set():  # set while the watch was opened: no one else will shut it
                return
            for line in iter_resp_lines(response):
                event = json.loads(line) if line else {}
                item = event.get("object") if isinstance(event, dict) else None
                if not isinstance(item, dict):
                    continue
                if event.get("type") == "ERROR":
                    raise ApiException(
                        status=int(item.get("code") or 500), reason=str(item.get("message") or "")
                    )
                if _ours(item, self.selector) or event.get("type") == "BOOKMARK":
                    yield str(event.get("type")), item
        finally:
            stopper.clear()
            response.close()
            response.release_conn()

    def log(self, pod: str, since: str, container: str = pods.MAIN_CONTAINER) -> str:
        """The task's container's log with timestamps, from the second of `since` on."""
        query: list[tuple[str, str]] = [("container", container), ("timestamps", "true")]
        if since:
            query.append(("sinceTime", since[:19] + "Z"))  # whole seconds; lines before are skipped here
        response = self.client.call_api(
            "/api/v1/namespaces/{namespace}/pods/{name}/log",
            "GET",
            path_params={"namespace": self.namespace, "name": pod},
            query_params=query,
            header_params={"Accept": "text/plain"},
            response_types_map={},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=60,
            _return_http_data_only=True,
        )
        return bytes(response.data or b"").decode(errors="replace")

    # The agent's Lease (agents.leadership), each write conditional on the version it read.

    def lease_get(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        try:
            return self._raw(
                self.coordination.read_namespaced_lease(
                    name, self.namespace, _preload_content=False, _request_timeout=10
                )
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def lease_create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._conflicting(self.coordination.create_namespaced_lease, self.namespace, dict(body))

    def lease_patch(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._conflicting(self.coordination.patch_namespaced_lease, name, self.namespace, dict(body))

    def _conflicting(self, call: Callable[..., Any], *args: Any) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        try:
            return self._raw(call(*args, _preload_content=False, _request_timeout=10))
        except ApiException as error:
            if error.status == 409:
                raise Conflict(str(error.reason)) from None
            raise

    def workloads(self) -> list[dict[str, Any]]:
        """Kueue's Workloads in the namespace: one per suspended Job, saying why it is not admitted."""
        from kubernetes import client  # noqa: PLC0415

        custom = client.CustomObjectsApi(self.client)
        data = custom.list_namespaced_custom_object(
            "kueue.x-k8s.io",
            "v1beta1",
            self.namespace,
            "workloads",
            _preload_content=False,
            _request_timeout=30,
        )
        return list(self._raw(data).get("items") or [])

    def nodes(self) -> list[dict[str, Any]]:
        return list(
            self._raw(self.core.list_node(_preload_content=False, _request_timeout=30)).get("items") or []
        )

    def all_pods(self) -> list[dict[str, Any]]:
        data = self._raw(
            self.core.list_pod_for_all_namespaces(
                field_selector="status.phase=Running", _preload_content=False, _request_timeout=60
            )
        )
        return list(data.get("items") or [])


def _ours(item: Mapping[str, Any], selector: str) -> bool:
    """The object carries this agent's label (the selector is checked here too, not only by the server)."""
    key, _, value = selector.partition("=")
    return ((item.get("metadata") or {}).get("labels") or {}).get(key) == value


# Reading objects ------------------------------------------------------------------------------------------


def _labels(item: Mapping[str, Any]) -> dict[str, str]:
    return dict((item.get("metadata") or {}).get("labels") or {})


def _name(item: Mapping[str, Any]) -> str:
    return str((item.get("metadata") or {}).get("name") or "")


def _condition(item: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    for condition in (item.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return dict(condition)
    return None


def _main_container(pod: Mapping[str, Any]) -> str:
    """The task's container: `main`, or `pytorch` in a PyTorchJob's pods."""
    return pods.PYTORCH_CONTAINER if TRAINING_JOB_LABEL in _labels(pod) else pods.MAIN_CONTAINER


def _main_status(pod: Mapping[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    main = _main_container(pod)
    return dict(next((s for s in statuses if s.get("name") == main), statuses[0] if statuses else {}))


def _index(pod: Mapping[str, Any]) -> int:
    """The pod's rank: its completion index, or in a PyTorchJob the Master's 0 and Worker i's i + 1."""
    labels = _labels(pod)
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(INDEX_ANNOTATION)
    value = value or labels.get(INDEX_ANNOTATION)
    try:
        if REPLICA_TYPE_LABEL in labels:
            worker = labels[REPLICA_TYPE_LABEL].lower() == "worker"
            return int(labels.get(REPLICA_INDEX_LABEL) or 0) + (1 if worker else 0)
        return int(value or 0)
    except ValueError:
        return 0


def job_view(workload: Mapping[str, Any]) -> dict[str, Any]:
    """A PyTorchJob as the Job the agent reads elsewhere: suspended (Kueue), how many pods, and its
    Succeeded or Failed condition as a Job's Complete or Failed."""
    spec = workload.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs") or {}
    conditions = []
    for condition in (workload.get("status") or {}).get("conditions") or []:
        kind = {"Succeeded": "Complete", "Failed": "Failed"}.get(str(condition.get("type")))
        if kind and condition.get("status") == "True":
            conditions.append({**condition, "type": kind})
    return {
        "metadata": dict(workload.get("metadata") or {}),
        "spec": {
            "suspend": bool((spec.get("runPolicy") or {}).get("suspend")),
            "parallelism": sum(int((item or {}).get("replicas") or 0) for item in replicas.values()),
        },
        "status": {"conditions": conditions},
    }


@dataclass(frozen=True)
class Seen:
    """What the Job and its pods say of the task, reduced to what the plane is told."""

    state: str  # pending, running, ended, failed (cannot run: fails without waiting), requeue
    reason: str = ""
    exit_code: int | None = None
    lines: tuple[str, ...] = ()  # what Kubernetes said of how it ended, for the task's log

    @property
    def key(self) -> str:
        return f"{self.state}|{self.reason}"


def what_is_seen(
    job: Mapping[str, Any], task_pods: list[dict[str, Any]], *, local_queue: str, admission: str = ""
) -> Seen:
    """The task's state from its Job and pods, as the cluster's own controllers left them; `admission` is
    what Kueue's Workload says of a suspended Job."""
    spec = job.get("spec") or {}
    ended = _ended(job, task_pods)
    if ended is not None:
        return ended
    if spec.get("suspend"):
        return kueue_wait(local_queue, admission)
    return _waiting(task_pods, wanted=int(spec.get("parallelism") or spec.get("completions") or 1))


def kueue_wait(local_queue: str, admission: str) -> Seen:
    """A workload Kueue holds suspended, in Kueue's own words where its Workload has some."""
    queue = f" {local_queue}" if local_queue else ""
    return Seen(
        "pending",
        f"waiting for Kueue to admit it into LocalQueue{queue}" + (f": {admission}" if admission else ""),
    )


def deleted(record: JobRecord) -> Seen:
    return Seen(
        "ended",
        "deleted",
        None,
        (f"kubernetes: {record.kind} {record.job_id} was deleted outside Klique (kubectl delete?); the task "
         "ended with it",),
    )  # fmt: skip


def _ended(job: Mapping[str, Any], task_pods: list[dict[str, Any]]) -> Seen | None:
    """How the Job ended (the Job controller's conditions), or None while it has not."""
    failed = _condition(job, "Failed")
    ended = _exit(task_pods)
    if _condition(job, "Complete") or _condition(job, "SuccessCriteriaMet"):
        return Seen("ended", "", 0, ended.lines)
    if failed:
        said = f"kubernetes: the Job failed: {failed.get('reason')}: {failed.get('message') or ''}"
        reason = ended.reason or str(failed.get("reason") or "")
        return Seen("ended", reason, ended.exit_code or 1, ended.lines or (said.strip(": "),))
    phases = [(pod.get("status") or {}).get("phase") for pod in task_pods]
    if task_pods and not any(_alive(pod) for pod in task_pods) and "Failed" in phases:
        return Seen("ended", ended.reason, ended.exit_code or 1, ended.lines)  # the Job's verdict to come
    return None


def _waiting(task_pods: list[dict[str, Any]], *, wanted: int) -> Seen:  # noqa: PLR0911 -- one per state
    """Running once every pod runs; else why not: an image, the scheduler's reason, half a gang."""
    images, unschedulable = [], []
    for pod in task_pods:
        why = (_main_status(pod).get("state") or {}).get("waiting") or {}
        reason = str(why.get("reason") or "")
        said = f"{reason}: {why.get('message') or ''}".strip(": ")
        if reason in HOPELESS:
            return Seen("failed", said)
        if reason in IMAGE_PULL:
            images.append(said)
        conditions = (pod.get("status") or {}).get("conditions") or []
        scheduled: dict[str, Any] = next(
            (item for item in conditions if item.get("type") == "PodScheduled"), {}
        )
        if scheduled.get("status") == "False":
            said = (
                f"{scheduled.get('reason') or 'Unschedulable'}: {scheduled.get('message') or 'no node fits'}"
            )
            unschedulable.append(said)
    phases = [(pod.get("status") or {}).get("phase") for pod in task_pods]
    running = phases.count("Running")
    done = running + phases.count("Succeeded")  # pods done before the Job controller's verdict
    if done and done >= wanted:
        return Seen("running")
    if images:
        return Seen("image", images[0])
    placed = [pod for pod in task_pods if (pod.get("spec") or {}).get("nodeName")]
    if unschedulable and (placed or running):
        placed_count = max(len(placed), running)
        return Seen("gang", f"{placed_count} of {wanted} pods placed; the rest wait: {unschedulable[0]}")
    if unschedulable:
        return Seen("pending", unschedulable[0])
    if task_pods:
        return Seen("pending", f"starting: {running} of {wanted} pods running")
    return Seen("pending", "submitted")


def _exit(task_pods: list[dict[str, Any]]) -> Seen:
    """The first failing pod's exit code (the lowest index), else 0; and what Kubernetes said of it."""
    codes: list[tuple[int, int]] = []
    lines: list[str] = []
    for pod in sorted(task_pods, key=_index):
        terminated = (_main_status(pod).get("state") or {}).get("terminated") or {}
        status = pod.get("status") or {}
        if status.get("reason") == "Evicted":
            lines.append(f"kubernetes: pod {_name(pod)} was evicted: {status.get('message') or ''}".strip())
            codes.append((_index(pod), 137))
            continue
        if not terminated:
            continue
        code = int(terminated.get("exitCode") or 0)
        codes.append((_index(pod), code))
        if terminated.get("reason") == "OOMKilled":
            lines.append(
                f"kubernetes: pod {_name(pod)} was killed for using more memory than its limit "
                "(OOMKilled): ask for a larger memory limit in the compute resource's pod template"
            )
        elif code and terminated.get("message"):
            lines.append(f"kubernetes: pod {_name(pod)}: {terminated['message']}"[:2000])
    failing = [code for _, code in codes if code]
    reason = (
        "OOMKilled"
        if any("OOMKilled" in line for line in lines)
        else ("Evicted" if any("evicted" in line for line in lines) else "")
    )
    return Seen("ended", reason, failing[0] if failing else (0 if codes else None), tuple(lines))


def admission_of(workloads: list[dict[str, Any]]) -> dict[str, str]:
    """Per Job, JobSet or PyTorchJob name (its Workload's owner), why Kueue has not admitted it: the message
    of the first of its QuotaReserved and Admitted conditions that is False."""
    found: dict[str, str] = {}
    for workload in workloads:
        owners = [ref.get("name") for ref in (workload.get("metadata") or {}).get("ownerReferences") or []
                  if ref.get("kind") in ("Job", "JobSet", "PyTorchJob")]  # fmt: skip
        conditions = {
            item.get("type"): item for item in (workload.get("status") or {}).get("conditions") or []
        }
        for kind in ("QuotaReserved", "Admitted"):
            condition = conditions.get(kind) or {}
            if condition.get("status") == "False" and condition.get("message"):
                for owner in owners:
                    found[str(owner)] = str(condition["message"])[:500]
                break
    return found


def log_lines(text: str, cursor: LogCursor) -> tuple[list[str], LogCursor]:
    """The lines of a timestamped log after the cursor, and the cursor after them. A last line without its
    newline is left for the next read: the kubelet may still be writing it."""
    complete = text[: text.rfind("\n") + 1] if "\n" in text else ""
    lines, since, seen = [], cursor.since, cursor.seen
    at_cursor = 0
    for raw in complete.split("\n")[:-1]:
        stamp, _, line = raw.partition(" ")
        if since and stamp < since:
            continue
        if stamp == cursor.since and cursor.since:
            at_cursor += 1
            if at_cursor <= cursor.seen:
                continue
        if stamp == since:
            seen += 1
        else:
            since, seen = stamp, 1
        lines.append(line)
    return lines, LogCursor(cursor.pod, since, seen)


# The backend ---------------------------------------------------------------------------------------------


@dataclass
class Kubernetes:
    name = "kubernetes"
    settings: KubeSettings
    state: State
    api: Api
    upload: Upload | None = None
    reporter: Report | None = None
    seen_jobs: dict[str, dict[str, Any]] = field(default_factory=dict)  # Job name -> as last seen
    seen_pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod name -> as last seen
    synced: set[str] = field(default_factory=set)  # "Job", "Pod" once listed
    # The API's last complaint, for the pool's status, one per kind of call: what reads (watches, lists)
    # ran into is cleared by the next read that works, and what creating ran into by the next creation;
    # a watch that lists again says nothing of whether the agent may create Jobs.
    read_problem: str = ""
    create_problem: str = ""
    since: dict[str, tuple[str, float]] = field(default_factory=dict)  # task -> (waiting kind, since when)
    closing: threading.Event = field(default_factory=threading.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    workers: list[asyncio.Task[None]] = field(default_factory=list)
    watchers: dict[str, list[Any]] = field(default_factory=lambda: {"Job": [], "Pod": []})
    ending: set[str] = field(default_factory=set)
    admission: dict[str, str] = field(default_factory=dict)  # Job name -> what Kueue says of it
    gone_jobs: set[str] = field(default_factory=set)  # recorded Jobs the cluster says are deleted
    created_at: dict[str, float] = field(default_factory=dict)  # Job name -> when this process made it
    admission_read: float = 0.0  # when Kueue's Workloads were last read
    leadership: Leadership | None = None  # with leader election: the Lease this process must hold
    workloads: dict[str, tuple[float, dict[str, dict[str, Any]]]] = field(default_factory=dict)  # kind ->
    # (listed when, JobSets or PyTorchJobs by name), listed every WORKLOAD_READ_SECONDS while needed
    served: tuple[float, frozenset[str]] = (0.0, frozenset())  # the custom workload kinds served, and when
    loop: asyncio.AbstractEventLoop | None = None
    reasons: dict[str, str] = field(default_factory=dict)  # task -> why it was stopped from outside (fail)
    tails: dict[str, list[str]] = field(default_factory=dict)  # task -> the last lines of its log read
    # Clustering services: the K3k Clusters as last listed (when, by name), whether the cluster serves them
    # (and when that was asked), and the runs whose kubeconfig Secret exists.
    clusters_seen: tuple[float, dict[str, dict[str, Any]]] = (0.0, {})
    clusters_served: tuple[float, bool] = (0.0, False)
    minted: set[str] = field(default_factory=set)
    orphans: dict[str, float] = field(default_factory=dict)  # cluster of no run -> when first seen so
    # Runs an earlier agent process took (their lease kept) but recorded no workload for: name -> task,
    # until a pass has looked whether their workload exists (`_sweep_unmade`); and those being swept.
    unmade: dict[str, str] = field(default_factory=dict)
    sweeping: dict[str, asyncio.Event] = field(default_factory=dict)

    # What the agent loop asks ---------------------------------------------------------------------------

    def inventory(self) -> dict[str, Any]:
        return {
            "scheduler": "kubernetes",
            "source": "kubernetes",
            "namespace": self.settings.cluster.namespace,
            "api": self.api.where,
            "jobs": len(self.state.jobs()),
        }

    def running(self) -> list[str]:
        return sorted(job.task_id for job in self.state.jobs())

    def queue(self) -> list[dict[str, Any]]:
        rows = []
        for record in self.state.jobs():
            state, _, reason = record.last.partition("|")
            rows.append(
                {
                    "task_id": record.task_id,
                    "job_id": record.job_id,
                    "state": state or "pending",
                    "cluster_state": state,
                    "reason": reason,
                }
            )
        return rows

    async def capacity(self) -> dict[str, Any]:
        """Nodes, their CPUs and GPUs (allocatable, and requested by running pods) per GPU class and MIG
        profile; {} while the nodes cannot be read (the agent's ClusterRole grants it)."""
        try:
            nodes, running = await self._call(self.api.nodes), await self._call(self.api.all_pods)
        except ApiProblem as problem:
            logger.warning("the cluster's nodes cannot be read: %s", problem)
            return {}
        return capacity_of(nodes, running)

    # Starting -------------------------------------------------------------------------------------------

    async def _call(
        self,
        function: Callable[..., T],
        *args: Any,
        verb: str = "read",
        resource: str = "nodes",
        **kwargs: Any,
    ) -> T:
        try:
            return await asyncio.to_thread(function, *args, **kwargs)
        except Exception as error:  # every client error, worded for an administrator
            if isinstance(error, ApiProblem):
                raise
            raise explain(error, verb, resource, self.settings.cluster.namespace, self.api.where) from None

    async def start(self, assignment: dict[str, Any], report: Report) -> None:
        """Create the task's Secret, Service and Job, or raise Refused with the reason."""
        self._follow(report)
        task_id = str(assignment["task_id"])
        if any(job.task_id == task_id for job in self.state.jobs()):
            return  # a repeated assignment of a task whose Job is already in the cluster
        spec = assignment.get("spec") or {}
        try:  # the one rule, checked again here: the agent trusts no one to have checked it
            environment = {
                **task_environment.checked(spec.get("environment")),
                **task_environment.checked(assignment.get("secrets") or {}, "The task's secrets"),
            }
        except task_environment.NameRefused as error:
            raise Refused(f"The task's environment cannot be set: {error}", permanent=True) from None
        try:
            task_volumes.chosen(task_volumes.wanted(spec.get("volumes")), self.settings.cluster.volumes)
        except task_volumes.VolumeRefused as error:
            raise Refused(str(error), permanent=True) from None
        relay = self._relay(spec) if "app" in spec else None
        template = self.settings.template_for(str(assignment.get("compute_resource") or ""))
        cluster = self.settings.cluster
        try:
            if int(assignment.get("nodes") or 1) > 1:
                cluster = dataclasses.replace(cluster, multi_node=await self._multi_node())
        except ApiProblem as problem:
            self.create_problem = str(problem)
            raise Refused(f"The multi-node workload was not created: {problem}", permanent=False) from None
        try:
            manifests = pods.render(
                template,
                assignment,
                cluster,
                tenant=str(assignment.get("tenant") or ""),
                environment=environment,
                relay=relay,
            )
        except pods.PodTemplateInvalid as error:
            raise Refused(str(error), permanent=True) from None
        name = manifests.job["metadata"]["name"]
        self.unmade.pop(name, None)  # taken up again: what an earlier process made of it is kept or made
        if name in self.sweeping:  # ... once a sweep of it under way is over
            await self.sweeping[name].wait()
        if manifests.cluster is not None:
            await self._check_clusters_served()
        await self._lease_written()
        try:
            await self._create(manifests)
        except ApiProblem as problem:
            self.create_problem = str(problem)
            for made in (manifests.secret, *(made for made, _ in manifests.beside())):  # none is left
                with contextlib.suppress(ApiProblem):
                    kind = str(made["kind"])
                    await self._call(
                        self.api.delete, kind, _name(made), verb="delete", resource=kind.lower() + "s"
                    )
            raise Refused(
                f"The {manifests.kind} was not created: {problem}", permanent=problem.permanent
            ) from None
        self.create_problem = ""
        user = str(assignment.get("user") or "")
        app = json.dumps(spec["app"]) if relay else ""
        self.state.add_job(JobRecord(task_id, name, cluster.namespace, user, kind=manifests.kind, app=app))
        logger.info("task %s is %s %s in namespace %s", task_id, manifests.kind, name, cluster.namespace)
        await report(task_id, "status", {"state": "pending", "reason": "submitted", "job_id": name}, None)
        self.state.job_seen(task_id, "pending|submitted")
        self.changed.set()

    def _relay(self, spec: Mapping[str, Any]) -> pods.Relay:
        """An app's relay: its sidecar's image and port, and a key for this run alone. The app's port was
        picked by the agent loop (a pod's network is its own: any port is free there)."""
        if not self.settings.relay_image:
            raise Refused(
                "This Kubernetes pool serves no apps: its agent has no relay_image in [agent.kubernetes] "
                "(the agent's own image; the klique-agent Helm chart sets it). Launch the app on another "
                "compute resource, or ask an administrator to set it.",
                permanent=True,
            )
        try:
            app_port = protocol_apps.AppSpec.parse(spec["app"]).port
        except protocol_apps.TemplateInvalid as error:
            raise Refused(f"The app cannot be run: {error}", permanent=True) from None
        if app_port is None:
            raise Refused("The app cannot be run: its port was not chosen.", permanent=True)
        relay_port = free_port()
        while relay_port == app_port:
            relay_port = free_port()
        return pods.Relay(self.settings.relay_image, relay_port, app_port, new_key())

    async def _multi_node(self) -> str:
        """The workload of a multi-node task: as configured, or with "auto" JobSet, else PyTorchJob, where the
        cluster serves it (asked again every DISCOVERY_SECONDS, so one installed later is taken up), else the
        Indexed Job. A kind asked for that the cluster does not serve is refused saying so."""
        chosen = self.settings.multi_node
        if chosen == "indexed-job":
            return chosen
        asked, served = self.served
        if not asked or time.monotonic() - asked >= DISCOVERY_SECONDS:
            found = set()
            for kind, (group, version, plural) in pods.CUSTOM_WORKLOADS.items():
                if await self._call(
                    self.api.serves, f"{group}/{version}", plural, verb="discover", resource="API groups"
                ):
                    found.add(kind)
            if frozenset(found) != served:
                logger.info(
                    "the cluster serves %s", ", ".join(sorted(found)) or "neither JobSet nor PyTorchJob"
                )
            served = frozenset(found)
            self.served = (time.monotonic(), served)
        if chosen == "auto":  # in order of preference
            preferred = (setting for setting, kind in pods.MULTI_NODE_WORKLOADS.items() if kind in served)
            return next(preferred, "indexed-job")
        kind = pods.MULTI_NODE_WORKLOADS[chosen]
        if kind not in served:
            group, version, plural = pods.CUSTOM_WORKLOADS[kind]
            product = "JobSet" if kind == "JobSet" else "the Kubeflow training operator"
            raise ApiProblem(
                f"the cluster at {self.api.where} does not serve {group}/{version} {plural}: install "
                f"{product}, or set multi_node to auto or indexed-job in [agent.kubernetes]",
                status=404,
            )
        return chosen

    async def _check_clusters_served(self) -> None:
        """A clustering service needs the K3k controller: its API group served (asked again every
        DISCOVERY_SECONDS while it is not, so one installed later is taken up). Refused, not for good,
        where it is not: the app waits in the queue while an administrator installs K3k."""
        try:
            await self._clusters_served()
        except ApiProblem as problem:
            self.create_problem = str(problem)
            raise Refused(f"The app's cluster was not made: {problem}", permanent=False) from None

    async def _clusters_served(self) -> None:
        asked, served = self.clusters_served
        if not served and (not asked or time.monotonic() - asked >= DISCOVERY_SECONDS):
            served = await self._call(
                self.api.serves, clusters.K3K_API, clusters.K3K_PLURAL, verb="discover", resource="API groups"
            )
            self.clusters_served = (time.monotonic(), served)
        if not served:
            raise ApiProblem(
                f"the cluster at {self.api.where} does not serve {clusters.K3K_API} {clusters.K3K_PLURAL}: "
                "install K3k (its controller and CRDs) to run K3k clusters on this pool, or launch the app "
                "on another Kubernetes compute resource",
                status=404,
            )

    async def _create(self, manifests: pods.Manifests) -> None:
        """The Secret first (the pods need it), the Service, then the Job (or JobSet), which then owns the
        other two. One that exists already is this run's own (the name carries the lease): an assignment
        repeated."""
        name = manifests.job["metadata"]["name"]
        if await self._create_one(manifests.secret, "secrets") is None:
            await self._call(self.api.refresh_secret, manifests.secret, verb="patch", resource="secrets")
        # The app's relay key (one there already holds the key a pod of the run may use), the Service, the
        # app's NetworkPolicy (it is never reachable but by its relay), a cluster or a Slurm controller's
        # objects (the pod waits for the kubeconfig, or mounts the cluster's files): before the Job.
        for made, kind in manifests.beside():
            await self._create_one(made, kind)
        custom = pods.CUSTOM_WORKLOADS.get(manifests.kind)
        resource = f"{custom[2]}.{custom[0]}" if custom else "jobs"
        job = await self._create_one(manifests.job, resource) or {}
        self.created_at[name] = time.monotonic()
        if custom and job:  # known now, not after the next listing
            self.workloads.setdefault(manifests.kind, (0.0, {}))[1][name] = job
        elif job and name not in self.seen_jobs:  # what the watch will say: known now, not after its lag
            self.seen_jobs[name] = job
        owned = [("Secret", name), *((str(made["kind"]), _name(made)) for made, _ in manifests.beside())]
        for kind, item in owned:
            with contextlib.suppress(ApiProblem):  # the agent deletes them itself anyway
                await self._call(self.api.own, kind, item, job, verb="patch", resource=kind.lower() + "s")

    async def _create_one(self, manifest: Mapping[str, Any], resource: str) -> dict[str, Any] | None:
        """The object as created, or None where it exists already."""
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        try:
            return await asyncio.to_thread(self.api.create, manifest)
        except ApiException as error:
            if error.status == 409:
                return None
            raise explain(
                error, "create", resource, self.settings.cluster.namespace, self.api.where
            ) from None
        except Exception as error:  # the API server unreachable, a timeout
            raise explain(
                error, "create", resource, self.settings.cluster.namespace, self.api.where
            ) from None

    # Following ------------------------------------------------------------------------------------------

    def adopt(self, report: Report) -> list[str]:
        """Follow the Jobs a previous agent process made: those in its state now, and, once the Jobs are
        listed, those it labelled but did not live to record. The runs it took but recorded no workload
        for are looked at by the first pass (`_sweep_unmade`)."""
        recorded = {record.task_id for record in self.state.jobs()}
        self.unmade = {
            pods.job_name(task, lease): task
            for task, lease in self.state.leases().items()
            if task not in recorded and not self.state.run_ended(task, lease)  # (ended: cleaned up)
        }
        self._follow(report)
        return self.running()

    def _follow(self, report: Report) -> None:
        self.reporter = report
        if self.workers and not all(worker.done() for worker in self.workers):
            return
        self.loop = asyncio.get_running_loop()
        self.closing.clear()
        for kind in ("Job", "Pod"):  # their own threads: a watch holds one for as long as it lasts
            threading.Thread(
                target=self._watch_forever, args=(kind,), name=f"watch-{kind}", daemon=True
            ).start()
        self.workers = [asyncio.create_task(self._follow_forever())]

    def _post(self, function: Callable[..., None], *args: Any) -> None:
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(function, *args)

    def _watch_forever(self, kind: str) -> None:
        """In a thread: list the kind, then watch it from the listing's version; after a drop watch on
        from the last version seen, and list again on 410 Gone."""
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        version, failures = "", 0
        while not self.closing.is_set():
            try:
                if not version:
                    items, version = self.api.listing(kind)
                    self._post(self._synced, kind, items)
                for kind_of_event, item in self.api.watch(
                    kind, version, self.settings.watch_seconds, self.watchers[kind], self.closing
                ):
                    if self.closing.is_set():
                        return
                    version = str((item.get("metadata") or {}).get("resourceVersion") or version)
                    if kind_of_event in ("ADDED", "MODIFIED", "DELETED"):
                        self._post(self._event, kind, kind_of_event, item)
                failures = 0
            except ApiException as error:
                if error.status == 410:
                    version = ""  # too old to watch from: list again
                    continue
                failures += 1
                self._post(
                    self._trouble,
                    str(explain(error, "watch", kind.lower() + "s", self.api.namespace, self.api.where)),
                )
                version = "" if failures > 3 else version
                self.closing.wait(min(30.0, 0.5 * 2**failures))
            except Exception as error:  # a cut connection, a timeout: watch on from where it was
                if self.closing.is_set():
                    return
                failures += 1
                self._post(
                    self._trouble,
                    str(explain(error, "watch", kind.lower() + "s", self.api.namespace, self.api.where)),
                )
                self.closing.wait(min(30.0, 0.2 * 2**failures))

    def _synced(self, kind: str, items: list[dict[str, Any]]) -> None:
        store = self.seen_jobs if kind == "Job" else self.seen_pods
        store.clear()
        store.update({_name(item): item for item in items})
        self.synced.add(kind)
        self.read_problem = ""
        if kind == "Job":
            # A recorded Job the listing lacks is gone (deleted while the watch was away): said so once
            # it is missed by a listing made after the agent created it, never on a watch's lag.
            listed_at = time.monotonic()
            self.gone_jobs = {
                record.job_id
                for record in self.state.jobs()
                if record.kind == "Job"  # a JobSet's Job comes after its controller's lag: the JobSet is read
                and record.job_id not in store
                and self._missed(record.job_id, listed_at)
            }
            self._adopt_labelled(self.seen_jobs)
        else:
            self._adopt_labelled(self.seen_pods)  # a PyTorchJob's pods: it has no Job
        self.changed.set()

    def _event(self, kind: str, event: str, item: dict[str, Any]) -> None:
        store = self.seen_jobs if kind == "Job" else self.seen_pods
        if event == "DELETED":
            store.pop(_name(item), None)
            if kind == "Job":
                self.gone_jobs.add(_name(item))
        else:
            store[_name(item)] = item
            if kind == "Job":
                self.gone_jobs.discard(_name(item))
        self.changed.set()

    def _trouble(self, problem: str) -> None:
        if problem != self.read_problem:
            logger.warning("%s", problem)
        self.read_problem = problem

    @property
    def problem(self) -> str:
        """What stops the cluster from taking work now, as the pool's status says it ("" for nothing)."""
        return "; ".join(problem for problem in (self.read_problem, self.create_problem) if problem)

    def _adopt_labelled(self, seen: Mapping[str, dict[str, Any]]) -> None:
        """Workloads this agent labelled for a run it holds but never recorded (it was killed between
        creating one and recording it), found by their Jobs (a Job, a JobSet's Job) or, for a PyTorchJob,
        its pods: recorded now, so they are followed, not made again."""
        recorded = {job.task_id for job in self.state.jobs()}
        for name, item in seen.items():
            labels = _labels(item)
            task = labels.get("klique.io/task", "")
            if not task or task in recorded:
                continue
            if labels.get(JOBSET_NAME_LABEL):
                kind, workload = "JobSet", labels[JOBSET_NAME_LABEL]
            elif labels.get(TRAINING_JOB_LABEL):
                kind, workload = "PyTorchJob", labels[TRAINING_JOB_LABEL]
            elif seen is self.seen_jobs:
                kind, workload = "Job", name
            else:
                continue  # a Job's pod: the Job itself is adopted
            lease = self.state.lease(task)
            if (
                not lease
                or pods.label_value(lease) != labels.get("klique.io/lease")
                or self.state.run_ended(task, lease)  # ended here, its result not yet answered
            ):
                continue
            annotations = (item.get("metadata") or {}).get("annotations") or {}
            submitter = str(annotations.get("klique.io/submitter") or "")
            app = str(annotations.get(pods.APP_ANNOTATION) or "")  # an app's section: its route reopens
            self.state.add_job(
                JobRecord(task, workload, self.settings.cluster.namespace, submitter, kind=kind, app=app)
            )
            recorded.add(task)
            logger.info("adopted %s %s of task %s", kind, workload, task)

    async def _follow_forever(self) -> None:
        while not self.closing.is_set():
            self.changed.clear()
            try:
                await self.look()
            except Exception:  # a surprise in one pass must not stop the following of every Job
                logger.exception("following the Kubernetes Jobs failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=self.settings.poll_seconds)

    def pods_of(self, record: JobRecord) -> list[dict[str, Any]]:
        return self._pods_by_job().get(_followed(record), [])

    def _pods_by_job(self) -> dict[str, list[dict[str, Any]]]:
        """The pods seen, by the name of the Job that made them: one pass, not one per Job."""
        found: dict[str, list[dict[str, Any]]] = {}
        for pod in self.seen_pods.values():
            labels = _labels(pod)
            job = next((labels[label] for label in JOB_NAME_LABELS if label in labels), None)
            if job is not None:
                found.setdefault(job, []).append(pod)
        return found

    async def look(self) -> None:
        """One pass over Klique's Jobs: read new log lines, report what changed, end what ended."""
        if self.reporter is None or {"Job", "Pod"} - self.synced:
            return
        if self.unmade:
            await self._sweep_unmade()
        records = self.state.jobs()
        await self._read_workloads(records)
        await self._read_admission(records)
        await self._read_clusters(records)
        by_job = self._pods_by_job()
        await asyncio.gather(
            *(
                self._look_at_run(record, by_job.get(_followed(record), []))
                for record in records
                if record.task_id not in self.ending
            )
        )

    async def _lease_written(self) -> None:
        """Wait until the state holds the run's lease on disk (the agent commits its state once per turn),
        so that an agent killed while it makes the run finds the run in its state and sweeps what it made
        (`adopt`, `_sweep_unmade`). Refused, not for good, where the state cannot be written now."""
        if not self.state.uncommitted:
            return
        before, deadline = self.state.commits, time.monotonic() + LEASE_WRITE_SECONDS
        tries = 0
        while self.state.commits == before:
            if time.monotonic() > deadline:
                raise Refused(
                    f"the agent's state could not be written in {LEASE_WRITE_SECONDS:.0f} s, so nothing of "
                    "the run was made; offer it again later",
                    permanent=False,
                )
            await asyncio.sleep(0 if tries < 20 else 0.005)  # the commit is the loop's next turn
            tries += 1

    async def _sweep_unmade(self) -> None:
        """Delete what a run of an earlier agent process left without its workload: a Secret (the run's
        variables and secrets), a Service, an app's or a Slurm controller's objects, made before the
        workload that would have owned them by an agent killed before it made it. A run whose workload
        exists (a Job, JobSet or PyTorchJob of its name: adopted, or its controller's Job not made yet) is
        left alone, as is one that a start takes up again (`start`: the same names, made anew or kept).
        By name, each: the agent's Role may delete Secrets but not list them. Where the workloads cannot
        be listed now, the next pass tries again."""
        made: set[str] = {record.job_id for record in self.state.jobs()} | set(self.seen_jobs)
        try:
            for kind, (group, version, plural) in pods.CUSTOM_WORKLOADS.items():
                served = await self._call(
                    self.api.serves, f"{group}/{version}", plural, verb="discover", resource="API groups"
                )
                if served:
                    made |= set(
                        await self._call(
                            self.api.custom_workloads, kind, verb="list", resource=f"{plural}.{group}"
                        )
                    )
        except ApiProblem as problem:
            self._trouble(str(problem))
            return
        while self.unmade:
            name, task = self.unmade.popitem()
            if name in made:
                continue
            logger.warning("task %s: its run %s was left without its workload; what it made goes", task, name)
            done = self.sweeping[name] = asyncio.Event()
            try:
                for kind, item in _made_beside(name):
                    try:
                        await self._call(
                            self.api.delete, kind, item, verb="delete", resource=kind.lower() + "s"
                        )
                    except ApiProblem as problem:
                        logger.warning("%s %s was not deleted: %s", kind, item, problem)
            finally:
                del self.sweeping[name]
                done.set()

    async def _read_workloads(self, records: list[JobRecord]) -> None:
        """List the JobSets whose Job is not seen yet and the PyTorchJobs (whose state is their own): one
        listing per kind, at most every WORKLOAD_READ_SECONDS, only while some run needs it."""
        needed = {
            record.kind for record in records if record.kind == "PyTorchJob" or self._job_not_made(record)
        }
        now = time.monotonic()
        for kind in sorted(needed):
            if now - self.workloads.get(kind, (0.0, {}))[0] < WORKLOAD_READ_SECONDS:
                continue
            group, _, plural = pods.CUSTOM_WORKLOADS[kind]
            try:
                listed = await self._call(
                    self.api.custom_workloads, kind, verb="list", resource=f"{plural}.{group}"
                )
            except ApiProblem as problem:
                self._trouble(str(problem))
                continue
            self.workloads[kind] = (time.monotonic(), listed)

    def _workload(self, record: JobRecord) -> tuple[dict[str, Any] | None, bool]:
        """The record's JobSet or PyTorchJob as last listed, and whether it is gone: missed by a listing
        made a while after this process created it (never on a listing's lag)."""
        listed_at, items = self.workloads.get(record.kind, (0.0, {}))
        found = items.get(record.job_id)
        return found, found is None and listed_at > 0 and self._missed(record.job_id, listed_at)

    def _missed(self, name: str, listed_at: float) -> bool:
        """Whether a listing made at `listed_at` that lacks `name` means it is gone: the listing came a while
        after this process created it (or this process did not), never on the API's lag."""
        return self.created_at.get(name, 0.0) < listed_at - 5.0

    def _job_not_made(self, record: JobRecord) -> bool:
        """A JobSet whose Job its controller has not made (or this agent not seen) yet."""
        return record.kind == "JobSet" and _followed(record) not in self.seen_jobs

    def _job_of(self, record: JobRecord) -> dict[str, Any] | None:
        """The Job the record's state is read from: its own, its JobSet's, or its PyTorchJob read as one."""
        if record.kind == "PyTorchJob":
            found, _ = self._workload(record)
            return job_view(found) if found is not None else None
        return self.seen_jobs.get(_followed(record))

    async def _read_admission(self, records: list[JobRecord]) -> None:
        """What Kueue says of the suspended Jobs (read at most every ADMISSION_SECONDS, and only while
        some Job waits for admission): a Workload's QuotaReserved or Admitted condition, when False."""
        suspended = [
            record.job_id
            for record in records
            if ((self._job_of(record) or {}).get("spec") or {}).get("suspend") or self._job_not_made(record)
        ]
        now = time.monotonic()
        if (
            not suspended
            or not self.settings.cluster.local_queue
            or now - self.admission_read < ADMISSION_SECONDS
        ):
            return
        self.admission_read = now
        try:
            workloads = await self._call(self.api.workloads, verb="list", resource="workloads.kueue.x-k8s.io")
        except ApiProblem as problem:
            if problem.status not in (403, 404):  # Kueue absent or not readable: the generic words stay
                self._trouble(str(problem))
            return
        self.admission = admission_of(workloads)

    async def _read_clusters(self, records: list[JobRecord]) -> None:
        """List this agent's K3k Clusters: every CLUSTER_READ_SECONDS while a clustering service runs (one
        listing for all of them), else every CLUSTER_SWEEP_SECONDS where K3k is served; then sweep."""
        now = time.monotonic()
        running = any(map(_cluster_of, records))
        if now - self.clusters_seen[0] < (CLUSTER_READ_SECONDS if running else CLUSTER_SWEEP_SECONDS):
            return
        if not running:
            try:
                await self._clusters_served()
            except ApiProblem:  # no K3k: no cluster of this agent's to look for
                self.clusters_seen = (now, {})
                return
        try:
            listed = await self._call(
                self.api.custom_workloads,
                clusters.K3K_KIND,
                verb="list",
                resource=f"{clusters.K3K_PLURAL}.{clusters.K3K_GROUP}",
            )
        except ApiProblem as problem:
            self._trouble(str(problem))
            return
        self.clusters_seen = (time.monotonic(), listed)
        await self._sweep_clusters(records, listed)

    async def _sweep_clusters(self, records: list[JobRecord], listed: Mapping[str, dict[str, Any]]) -> None:
        """Delete the clusters of no run of this agent's: made by an agent killed before it made the run's
        Job (whose owner reference would have had Kubernetes delete them with it). Each is left
        CLUSTER_ORPHAN_SECONDS first, for a start or an adoption under way: it holds GPUs no run counts."""
        runs = {record.job_id for record in records}
        now = time.monotonic()
        for name in set(self.orphans) - set(listed):
            del self.orphans[name]
        for name, item in listed.items():
            job = _labels(item).get("klique.io/job", "")
            if job in runs:
                self.orphans.pop(name, None)
                continue
            if now - self.orphans.setdefault(name, now) < CLUSTER_ORPHAN_SECONDS:
                continue
            logger.warning(
                "the K3k Cluster %s belongs to no run of this agent's (Job %s): deleted", name, job
            )
            for kind, item_name in ((clusters.K3K_KIND, name), ("Secret", clusters.kubeconfig_secret(job))):
                try:
                    await self._call(
                        self.api.delete, kind, item_name, verb="delete", resource=kind.lower() + "s"
                    )
                except ApiProblem as problem:
                    logger.warning("%s %s was not deleted: %s", kind, item_name, problem)
            self.orphans.pop(name, None)

    async def _cluster_looked(self, record: JobRecord, task_pods: list[dict[str, Any]]) -> bool:
        """A clustering service's run, as its cluster says: ended where the cluster failed or was deleted;
        waiting (and said so) until it is ready; then its kubeconfig minted once. True where this said
        all there was to say of the run this pass."""
        name = clusters.cluster_name(record.job_id)
        listed_at, items = self.clusters_seen
        found = items.get(name)
        if found is None:
            if listed_at > 0 and self._missed(record.job_id, listed_at):
                line = f"kubernetes: the K3k Cluster {name} was deleted outside Klique; the app ended with it"
                await self._cluster_over(record, task_pods, "deleted", line)
                return True
            return False  # not listed since it was made
        phase, said = clusters.phase_of(found)
        if phase in clusters.PHASES_FAILED:
            line = f"kubernetes: the K3k Cluster {name} failed" + (f": {said}" if said else "")
            await self._cluster_over(record, task_pods, "cluster failed", line)
            return True
        if record.job_id in self.minted:
            return False
        return await self._until_ready(record, name, found, phase, said)

    async def _until_ready(
        self, record: JobRecord, name: str, cluster: Mapping[str, Any], phase: str, said: str
    ) -> bool:
        """Until the cluster is ready and its kubeconfig minted, the run waits for it and says so."""
        if phase != "Ready":
            waiting = f"waiting for the K3k Cluster {name} to be ready ({phase}" + (
                f": {said})" if said else ")"
            )
            await self._tell(record, Seen("pending", waiting))
            return True
        problem = await self._mint(record, name, cluster)
        if problem:
            await self._tell(record, Seen("pending", f"the K3k Cluster {name} is ready; {problem}"))
            return True
        return False

    async def _mint(self, record: JobRecord, name: str, cluster: Mapping[str, Any]) -> str:
        """The run's kubeconfig Secret, made once from the K3k controller's bootstrap Secret and owned by the
        run's Job; "" once it exists, else what keeps it from being made (the pass after tries again)."""
        namespace = self.settings.cluster.namespace
        try:
            bootstrap = await self._call(
                self.api.secret_value, clusters.bootstrap_secret(name), "bootstrap", resource="secrets"
            )
            config = k3k.admin_kubeconfig(
                bootstrap, server=f"https://{clusters.server_host(name, namespace)}", name=name
            )
        except ApiProblem as problem:
            if problem.status != 404:
                self._trouble(str(problem))
            return f"its bootstrap Secret {clusters.bootstrap_secret(name)} cannot be read yet ({problem})"
        except k3k.BootstrapUnreadable as error:
            return str(error)
        labels = dict((cluster.get("metadata") or {}).get("labels") or {})
        secret_name = clusters.kubeconfig_secret(record.job_id)
        secret: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": secret_name,
                "namespace": namespace,
                "labels": labels,
            },
            "type": "Opaque",
            "stringData": {clusters.KUBECONFIG_KEY: config},
        }
        try:
            await self._create_one(secret, "secrets")  # one there already was minted before a restart
        except ApiProblem as problem:
            self._trouble(str(problem))
            return f"its kubeconfig Secret was not made ({problem})"
        job = self.seen_jobs.get(record.job_id)
        if job is not None:
            with contextlib.suppress(ApiProblem):  # the agent deletes it itself anyway
                await self._call(self.api.own, "Secret", secret_name, job, verb="patch", resource="secrets")
        self.minted.add(record.job_id)
        logger.info(
            "task %s: the K3k Cluster %s is ready; its kubeconfig is in the app's pod", record.task_id, name
        )
        return ""

    async def _cluster_over(
        self, record: JobRecord, task_pods: list[dict[str, Any]], reason: str, line: str
    ) -> None:
        """The cluster of a clustering service is gone or failed: its app goes with it, the task ends."""
        await self._delete_pods(record, task_pods, grace=0)
        await self._end(record, Seen("ended", reason, None, (line,)), [], delete_job=True)

    async def _look_at_run(self, record: JobRecord, task_pods: list[dict[str, Any]]) -> None:
        """A clustering service's run is looked at through its cluster first, then as any other."""
        if not record.stopping and _cluster_of(record) and await self._cluster_looked(record, task_pods):
            return
        await self._look_at(record, task_pods)

    async def _look_at(self, record: JobRecord, task_pods: list[dict[str, Any]]) -> None:
        assert self.reporter is not None
        job = self._job_of(record)
        await self._read_logs(record, task_pods)
        if job is None:
            await self._without_job(record, task_pods)
            return
        seen = what_is_seen(
            job,
            task_pods,
            local_queue=self.settings.cluster.local_queue,
            admission=self.admission.get(record.job_id, ""),
        )
        if record.stopping:
            if seen.state == "ended":
                await self._end(record, seen, task_pods)
            return
        if seen.state == "ended":
            await self._end(record, seen, task_pods)
            return
        if seen.state == "failed":
            await self._give_up(record, seen.reason, task_pods)
            return
        waited = self._waited(record.task_id, seen.state)
        if seen.state == "image" and waited > self.settings.image_pull_seconds:
            await self._give_up(record, f"{seen.reason} (for {waited:.0f} s)", task_pods)
            return
        if seen.state == "gang" and waited > self.settings.gang_seconds:
            await self._requeue(
                record,
                f"only part of the multi-node job could be placed for {waited:.0f} s "
                f"({seen.reason}); it was taken back so it holds no GPUs",
            )
            return
        await self._tell(record, seen)

    async def _tell(self, record: JobRecord, seen: Seen) -> None:
        """Report the task's state where it changed."""
        assert self.reporter is not None
        if seen.state == "pending" and record.last.startswith("running|"):
            return  # a pod done before the Job's verdict: still running, as far as the task goes
        if seen.key != record.last:
            body: dict[str, Any] = {
                "state": "running" if seen.state == "running" else "pending",
                "job_id": record.job_id,
                "cluster_state": seen.state,
            }
            if seen.state != "running":
                body["reason"] = seen.reason
            await self.reporter(record.task_id, "status", body, None)
            self.state.job_seen(record.task_id, seen.key)

    async def _without_job(self, record: JobRecord, task_pods: list[dict[str, Any]]) -> None:
        """The run's Job is not seen: a stopped one's pods are gone, its JobSet has not made it yet, its
        PyTorchJob is not listed yet, or it was deleted outside Klique."""
        if record.stopping:
            if not any(_alive(pod) for pod in task_pods):
                await self._end(record, Seen("ended", "stopped", _exit(task_pods).exit_code), task_pods)
        elif record.kind == "JobSet":
            await self._jobset_without_job(record, task_pods)
        elif record.job_id in self.gone_jobs or (record.kind != "Job" and self._workload(record)[1]):
            await self._end(record, deleted(record), task_pods)

    async def _jobset_without_job(self, record: JobRecord, task_pods: list[dict[str, Any]]) -> None:
        """A JobSet whose Job is not seen: its controller has not made it yet (or Kueue holds the JobSet),
        or the JobSet has ended or is gone; the JobSets are listed every WORKLOAD_READ_SECONDS to tell."""
        jobset, gone_now = self._workload(record)
        if jobset is None:
            if gone_now:  # else not listed yet
                await self._end(record, deleted(record), task_pods)
            return
        failed, completed = _condition(jobset, "Failed"), _condition(jobset, "Completed")
        if failed or completed:  # ended, and its Job gone before the agent saw how (its TTL, a restart)
            said = f"kubernetes: the JobSet {'completed' if completed else 'failed'}"
            if failed:
                said += f": {failed.get('reason') or ''}: {failed.get('message') or ''}".rstrip(": ")
            ended = _exit(task_pods)
            code = 0 if completed else (ended.exit_code or 1)
            await self._end(record, Seen("ended", ended.reason, code, (*ended.lines, said)), task_pods)
            return
        if (jobset.get("spec") or {}).get("suspend"):
            seen = kueue_wait(self.settings.cluster.local_queue, self.admission.get(record.job_id, ""))
        else:
            seen = Seen(
                "pending",
                f"waiting for the JobSet controller to make Job {_followed(record)} (is JobSet installed and "
                "running in the cluster?)",
            )
        await self._tell(record, seen)

    def _waited(self, task_id: str, kind: str) -> float:
        now = time.monotonic()
        last = self.since.get(task_id)
        if last is None or last[0] != kind:
            self.since[task_id] = (kind, now)
            return 0.0
        return now - last[1]

    async def _read_logs(self, record: JobRecord, task_pods: list[dict[str, Any]]) -> None:
        assert self.reporter is not None
        spec = (self._job_of(record) or {}).get("spec") or {}
        many = len(task_pods) > 1 or int(spec.get("completions") or spec.get("parallelism") or 1) > 1
        for pod in sorted(task_pods, key=_index):
            if not _started(pod):
                continue
            name = _name(pod)
            cursor = self.state.log_cursor(record.task_id, name)
            try:
                text = await self._call(
                    self.api.log, name, cursor.since, _main_container(pod), verb="read", resource="pods/log"
                )
            except ApiProblem as problem:
                if problem.status != 404:
                    self._trouble(str(problem))
                continue
            lines, after = log_lines(text, cursor)
            if lines:
                stream = f"rank-{_index(pod)}" if many else "stdout"
                pieces = [piece for line in lines for piece in split_lines(line)]
                if record.app:  # an app stopped from outside quotes them
                    kept = [*self.tails.get(record.task_id, []), *lines]
                    self.tails[record.task_id] = kept[-LOG_TAIL_LINES:]
                await self.reporter(record.task_id, "log", {"stream": stream, "lines": pieces}, after)

    async def _end(
        self, record: JobRecord, seen: Seen, task_pods: list[dict[str, Any]], *, delete_job: bool = False
    ) -> None:
        """The Job ended: its last log lines, its outputs, its result; then its Secret and Service go (and
        the Job, when asked)."""
        assert self.reporter is not None
        self.ending.add(record.task_id)
        try:
            await self._read_logs(record, task_pods)
            if seen.lines:
                await self.reporter(
                    record.task_id, "log", {"stream": "cluster", "lines": list(seen.lines)}, None
                )
            uploaded, failed = await self._upload_outputs(record, task_pods)
            cluster = {
                "scheduler": "kubernetes",
                "kind": record.kind,
                "job_id": record.job_id,
                "namespace": record.folder,
                "state": seen.reason or seen.state,
            }
            result: dict[str, Any] = {
                "exit_code": seen.exit_code,
                "stopped": record.stopping,
                "outputs": uploaded,
                "outputs_failed": failed,
                "cluster": cluster,
            }
            if reason := self.reasons.pop(record.task_id, ""):
                result["reason"] = reason
            await self.reporter(record.task_id, "result", result, None)
            self._forget(record)
            await self._clean(record, workload=delete_job)
        finally:
            self.ending.discard(record.task_id)

    async def _clean(self, record: JobRecord, *, workload: bool) -> None:
        """The run's Secret and Service (and its workload, when asked) are deleted; the workload itself
        otherwise stays until its TTL, for `kubectl describe`."""
        name = record.job_id
        made = [("Secret", name), ("Service", name)]
        if record.app:
            made += [("Secret", pods.app_objects_name(name)), ("NetworkPolicy", pods.app_objects_name(name))]
        service = _service_of(record)
        if service is not None and service.service == "k3k":  # never kept for the TTL: it holds GPUs
            made += [
                (clusters.K3K_KIND, clusters.cluster_name(name)),
                ("Secret", clusters.kubeconfig_secret(name)),
            ]
        elif service is not None:  # a Slurm controller's: its workers' tasks end with it (the plane's)
            made += [("Secret", clusters.slurm_secret(name)), ("Service", clusters.slurm_controller(name))]
        if workload:
            made.append((record.kind, name))
        for kind, item in made:
            try:
                await self._call(self.api.delete, kind, item, verb="delete", resource=kind.lower() + "s")
            except ApiProblem as problem:
                logger.warning("%s %s was not deleted: %s", kind, item, problem)

    async def _give_up(self, record: JobRecord, reason: str, task_pods: list[dict[str, Any]]) -> None:
        """The task cannot run as asked (an image that cannot be pulled): its Job goes, the task fails."""
        await self._delete_pods(record, task_pods, grace=0)
        line = f"kubernetes: the task cannot start: {reason}"
        await self._end(record, Seen("ended", "cannot start", None, (line,)), [], delete_job=True)

    async def _requeue(self, record: JobRecord, reason: str) -> None:
        """Give the task back to Klique's queue: its Job goes at once, nothing of it runs on."""
        assert self.reporter is not None
        await self._delete_pods(record, self.pods_of(record), grace=0)
        await self._clean(record, workload=True)
        await self.reporter(
            record.task_id, "log", {"stream": "cluster", "lines": [f"kubernetes: {reason}"]}, None
        )
        await self.reporter(
            record.task_id,
            "result",
            {"exit_code": None, "requeue": True, "reason": reason, "stopped": False, "outputs": []},
            None,
        )
        self._forget(record)

    def _forget(self, record: JobRecord) -> None:
        """The run is over for this agent: its record, timers and the watch's notes of it go."""
        self.state.remove_job(record.task_id)
        self.since.pop(record.task_id, None)
        self.tails.pop(record.task_id, None)
        self.created_at.pop(record.job_id, None)
        self.gone_jobs.discard(record.job_id)
        self.minted.discard(record.job_id)
        for _, items in self.workloads.values():
            items.pop(record.job_id, None)

    async def _upload_outputs(
        self, record: JobRecord, task_pods: list[dict[str, Any]]
    ) -> tuple[list[str], list[dict[str, str]]]:
        """The files the task wrote to its folder on the work volume that match its declared outputs (the
        run's Job, or its pods, say which). Without a work volume they cannot be read: each declared pattern
        is said to be not stored."""
        patterns: list[str] = []
        for item in [self._job_of(record) or {}, *task_pods]:
            annotation = ((item.get("metadata") or {}).get("annotations") or {}).get("klique.io/outputs")
            if annotation:
                with contextlib.suppress(ValueError):
                    patterns = [str(pattern) for pattern in json.loads(annotation)]
                break
        if not patterns:
            return [], []
        if self.settings.outputs_dir is None:
            why = "the agent has no work volume (outputs_dir and work_volume in [agent.kubernetes])"
            return [], [{"name": pattern, "error": why} for pattern in patterns]
        folder = self.settings.outputs_dir / record.task_id
        return await upload_outputs(folder, record.task_id, patterns, self.upload, self.reporter)

    # Apps -------------------------------------------------------------------------------------------------

    app_ports_here = True  # the agent names the app's port: a pod's network is its own, any port is free
    makes_clusters = True  # clustering services' clusters (protocol.clusters) are made beside their apps

    def _record(self, task_id: str) -> JobRecord | None:
        return next((job for job in self.state.jobs() if job.task_id == task_id), None)

    def spec_of(self, task_id: str) -> dict[str, Any]:
        """What the agent needs again of a run after a restart: an app's section; {} for other runs."""
        record = self._record(task_id)
        return {"app": json.loads(record.app)} if record is not None and record.app else {}

    async def app_upstream(self, task_id: str, app: protocol_apps.AppSpec) -> NodeRelay | None:
        """The way to the app of a run once its pod runs, all of it the cluster's word: the pod's address,
        the ports its relay sidecar was given, and the key in the run's app Secret (so an agent that lost
        its state, or adopted the run, reaches the same relay). None if the run ends first."""
        while (record := self._record(task_id)) is not None and record.app and not record.stopping:
            for pod in self.pods_of(record):
                status = pod.get("status") or {}
                ports = pods.relay_ports(pod.get("spec") or {})
                if status.get("phase") != "Running" or not status.get("podIP") or ports is None:
                    continue
                try:
                    key = await self._call(
                        self.api.secret_value,
                        pods.app_objects_name(record.job_id),
                        "key",
                        verb="read",
                        resource="secrets",
                    )
                except ApiProblem as problem:
                    logger.warning("task %s: its app's key cannot be read: %s", task_id, problem)
                    break
                if not re.fullmatch(r"[0-9a-f]{64}", key):
                    logger.warning("task %s: its app Secret holds no key", task_id)
                    break
                relay_port, app_port = ports
                where = f"pod {_name(pod)}"
                return await NodeRelay(status["podIP"], relay_port, app_port, key, place=where).open()
            await asyncio.sleep(APP_LOOK_SECONDS)
        return None

    async def fail(self, task_id: str, reason: str, grace_seconds: float = 10.0) -> None:
        """Stop a run for a reason outside its command (an app that never answered its health check): the
        reason, with the last lines of its log, goes into its result."""
        if self._record(task_id) is None:
            return
        self.reasons[task_id] = with_log_end(reason, "\n".join(self.tails.get(task_id, [])))
        await self.stop(task_id, grace_seconds)

    # Stopping -------------------------------------------------------------------------------------------

    async def stop(self, task_id: str, grace_seconds: float) -> None:
        """Delete the task's pods with the grace period (SIGTERM, then SIGKILL after it), and its Job."""
        record = self._record(task_id)
        if record is None:
            return
        self.state.job_stopping(task_id)
        task_pods = self.pods_of(record)
        waiting = not any((pod.get("status") or {}).get("phase") == "Running" for pod in task_pods)
        grace = 0 if waiting else max(0, int(grace_seconds))
        # The JobSet and its Job first, orphaning the pods, so no controller starts another while they stop.
        workloads = [(record.kind, record.job_id)]
        if record.kind == "JobSet":
            workloads.append(("Job", _followed(record)))
        for kind, name in workloads:
            try:
                await self._call(
                    self.api.delete,
                    kind,
                    name,
                    propagation="Orphan",
                    verb="delete",
                    resource=kind.lower() + "s",
                )
            except ApiProblem as problem:
                logger.warning("the %s %s was not deleted: %s", kind, name, problem)
        await self._delete_pods(record, task_pods, grace=grace)
        self.changed.set()

    async def _delete_pods(self, record: JobRecord, task_pods: list[dict[str, Any]], *, grace: int) -> None:
        for pod in task_pods:
            try:
                await self._call(
                    self.api.delete, "Pod", _name(pod), grace=grace, verb="delete", resource="pods"
                )
            except ApiProblem as problem:
                logger.warning("pod %s of task %s was not deleted: %s", _name(pod), record.task_id, problem)

    async def stop_all(self, grace_seconds: float) -> None:
        """An agent that stops leaves its Jobs to the cluster; the next agent adopts them."""
        self.closing.set()
        for stopper in self.watchers.values():
            for response in list(stopper):
                # Closing a response that another thread reads blocks on that thread; shutting its socket
                # down wakes the reader, which sees `closing` and ends.
                sock = getattr(getattr(response, "connection", None), "sock", None)
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
        for worker in self.workers:
            worker.cancel()


def _made_beside(name: str) -> list[tuple[str, str]]:
    """Every object a run named `name` may have beside its workload, whatever the run was (an app, a
    clustering service): its Secret and Service, an app's key Secret and NetworkPolicy, a Slurm
    controller's Secret and Service. (A K3k Cluster of no run is swept apart: `_sweep_clusters`.)"""
    app = pods.app_objects_name(name)
    return [
        ("Secret", name),
        ("Service", name),
        ("Secret", app),
        ("NetworkPolicy", app),
        ("Secret", clusters.slurm_secret(name)),
        ("Service", clusters.slurm_controller(name)),
    ]


def _service_of(record: JobRecord) -> clusters.ClusterService | None:
    """The clustering service of a run (its app section says), else None."""
    if not record.app or '"cluster"' not in record.app:
        return None
    try:
        section = json.loads(record.app).get("cluster")
        return clusters.ClusterService.parse(section) if section is not None else None
    except (ValueError, AttributeError):
        return None


def _cluster_of(record: JobRecord) -> clusters.ClusterService | None:
    """The K3k cluster of a clustering service's run, made and followed by the agent, else None."""
    service = _service_of(record)
    return service if service is not None and service.service == "k3k" else None


def _followed(record: JobRecord) -> str:
    """What the record's pods are grouped by: its Job, its JobSet's one Job, or its PyTorchJob."""
    return pods.followed_job(record.kind, record.job_id)


def _alive(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Pending", "Running", None)


def _started(pod: Mapping[str, Any]) -> bool:
    state = _main_status(pod).get("state") or {}
    return "running" in state or "terminated" in state


def _quantity(value: object) -> float:
    """A Kubernetes quantity as a number ("4", "3500m", "2k")."""
    text = str(value or "0")
    units = {"m": 0.001, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            try:
                return float(text[: -len(suffix)]) * units[suffix]
            except ValueError:
                return 0.0
    try:
        return float(text)
    except ValueError:
        return 0.0


def capacity_of(nodes: list[dict[str, Any]], running: list[dict[str, Any]]) -> dict[str, Any]:
    """The capacity message of a cluster: nodes, CPUs (those requested by running pods), and per GPU class
    (the node's `nvidia.com/gpu.product` label, else its resource name) and MIG profile, how many are
    allocatable and how many running pods ask for."""
    cpus, cpus_in_use, ready = 0.0, 0.0, 0
    gpus: dict[tuple[str, str], list[int]] = {}
    node_class: dict[str, str] = {}
    for node in nodes:
        name = _name(node)
        status = node.get("status") or {}
        if (node.get("spec") or {}).get("unschedulable"):
            continue
        ready += 1
        allocatable = status.get("allocatable") or {}
        cpus += _quantity(allocatable.get("cpu"))
        product = _labels(node).get("nvidia.com/gpu.product", "")
        node_class[name] = product
        for resource, amount in allocatable.items():
            if GPU_RESOURCE.fullmatch(str(resource)) and _quantity(amount) > 0:
                gpus.setdefault((product or resource, resource), [0, 0])[0] += int(_quantity(amount))
    for pod in running:
        product = node_class.get(str((pod.get("spec") or {}).get("nodeName") or ""), "")
        for container in (pod.get("spec") or {}).get("containers") or []:
            resources = container.get("resources") or {}
            asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            cpus_in_use += _quantity(asked.get("cpu"))
            for resource, amount in asked.items():
                if GPU_RESOURCE.fullmatch(str(resource)):
                    gpus.setdefault((product or resource, resource), [0, 0])[1] += int(_quantity(amount))
    return {
        "nodes": ready,
        "cpus": round(cpus),
        "cpus_in_use": min(round(cpus), round(cpus_in_use)),
        "gpus": [
            {"class": gpu_class, "resource": resource, "allocatable": counts[0], "allocated": counts[1]}
            for (gpu_class, resource), counts in sorted(gpus.items())
        ],
    }
