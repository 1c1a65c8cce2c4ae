"""Pod templates for Kubernetes: a task rendered into a `batch/v1` Job, its Secret and, for a multi-node
task, the headless Service its pods meet through.

A compute resource's pod template is YAML shaped like a pod template (`metadata` with labels and
annotations, `spec` a PodSpec): node selectors, tolerations, affinity, a priority class, a service account,
a `schedulerName` with its gang annotations, volumes, an image. Klique owns the rest and merges it in:

- the Job: its name, namespace, labels and annotations (tenant, task, lease, submitter), `backoffLimit: 0`
  (a failed attempt is the plane's to retry), `ttlSecondsAfterFinished`, `suspend` and the Kueue queue
  label where the pool names a LocalQueue, and for a multi-node task an Indexed Job of one pod per node;
- the task's container (the one named `main`, else the first): its command, its GPUs from the task's size
  (whole GPUs, a MIG slice, or a share of one: see `gpu_limits`), Klique's variables, and the task's
  environment and secrets from the task's Secret (`envFrom`), never as values in the pod spec;
- `restartPolicy: Never`, the shared file system at the same path as on every pool, the task's folder on
  the work volume, and an `emptyDir` scratch;
- for an app from the catalogue (`Relay`), its relay as a native sidecar (an init container that keeps
  running, Kubernetes 1.29 and later): `klique-node relay` from the agent's image, confined (no
  capabilities, not root, a read-only root), which leads to the app on the pod's loopback only for a
  caller who opens with the run's key (agents.relay, agents.node.AppRelay). The key is in a Secret of its
  own that only the sidecar reads, never in the app's environment; a NetworkPolicy of its own admits
  connections to the relay's port only (`app_network_policy`).

A multi-node task is one of three workloads (`ClusterSettings.multi_node`), one pod per node either way:
- `indexed-job`: an Indexed Job of one pod per node and a headless Service Klique makes for their names;
- `jobset`: a JobSet (jobset.x-k8s.io/v1alpha2) of one replicated Job, that same Indexed Job, whose
  controller makes the headless Service and gives the pods their names; its failure policy restarts
  nothing (a failed attempt is the plane's to retry, as for every task);
- `pytorchjob`: the Kubeflow training operator's PyTorchJob (kubeflow.org/v1), a Master and N-1 Workers
  of the same pod, the task's container named `pytorch` as the operator wants it; the operator makes the
  pods and their Services and sets the rendezvous variables itself (MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
  RANK); nothing restarts (`restartPolicy: Never`, `runPolicy.backoffLimit: 0`).
The agent picks JobSet where the cluster serves it, else the PyTorchJob where the operator is installed,
since Kueue and the cluster's tooling then see the gang as one workload; else the Indexed Job.

Placeholders `${name}` (see VARIABLES) are replaced inside string values only, after the YAML is parsed,
so a value can never change the document's structure; `$${` writes a literal `${`. The template may not use
anchors or aliases (a few lines of them expand to gigabytes), must be at most MAX_TEMPLATE_BYTES, and may
not name GPUs other than what the task's profile counts. Every refusal names the template and the line.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from protocol import clusters
from protocol import volumes as task_volumes
from protocol.units import UNITS_PER_GPU

KUBERNETES_VERSION = "1.34"  # the API the manifests are validated against (kubernetes-validate's schemas)
MAX_TEMPLATE_BYTES = 64 * 1024
MAIN_CONTAINER = "main"
WORK_PATH = "/klique"  # the task's folder is WORK_PATH/<task id> on the work volume
SCRATCH_PATH = "/scratch"
RENDEZVOUS_PORT = 29500  # torch.distributed's default
JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
JOBSET_API = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
JOBSET_REPLICATED = "node"  # the JobSet's one replicated Job: its Job is <jobset>-node-0
PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, PYTORCHJOB_PLURAL = "kubeflow.org", "v1", "pytorchjobs"
PYTORCHJOB_API = f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}"
PYTORCH_CONTAINER = "pytorch"  # the container the training operator gives the rendezvous variables to
MULTI_NODE_KINDS = ("indexed-job", "jobset", "pytorchjob")
# The multi-node settings that need a workload the cluster must serve, in the order "auto" prefers them.
MULTI_NODE_WORKLOADS = {"jobset": "JobSet", "pytorchjob": "PyTorchJob"}
# The workloads Klique makes beside batch/v1 Jobs, by kind: (group, version, plural).
CUSTOM_WORKLOADS = {
    "JobSet": (JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL),
    "PyTorchJob": (PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, PYTORCHJOB_PLURAL),
}
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # on each pod of an Indexed Job
RELAY_CONTAINER = "klique-relay"  # an app's relay, the pod's sidecar
APP_ANNOTATION = "klique.io/app"  # an app run's section of its spec, on its Job and pod
RELAY_USER = 65534  # the relay runs as nobody: it reads nothing but its code
APP_KEY_VARIABLE = "KLIQUE_APP_KEY"  # the relay's key (agents.node's name for it)

VARIABLES = {
    "task_id": "the task's id",
    "task_name": "the task's name as its submitter gave it",
    "job_name": "the Job's name (also the headless Service's, for multi-node tasks)",
    "namespace": "the namespace the Job is created in",
    "lease_id": "the run's lease",
    "user": "the submitter's user name",
    "project": "the task's project, or empty",
    "compute_resource": "the compute resource the task was submitted to",
    "image": "the task's image (its spec's `image`), else the agent's default image",
    "gpus": "GPUs per node, whole or a fraction (`0.5`)",
    "nodes": "how many nodes (pods) the task spans",
}

DEFAULT_TEMPLATE = """\
metadata:
  labels: {}
spec:
  containers:
    - name: main
      image: ${image}
"""

# Resources that are GPUs, whatever the vendor or slicing: only Klique sets them.
GPU_RESOURCE = re.compile(r"(nvidia\.com/(gpu(\.shared)?|mig-[a-z0-9.]+)|amd\.com/gpu|gpu\.intel\.com/\w+)")
PLACEHOLDER = re.compile(r"\$(\$\{|\{([A-Za-z_][A-Za-z0-9_]*)\})")
LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")
NAME_PIECE = re.compile(r"[^a-z0-9-]+")


class PodTemplateInvalid(ValueError):
    """A template that cannot be used: the message names the template and the line."""

    def __init__(self, template: str, line: int | None, problem: str) -> None:
        where = f"line {line}" if line else "the template"
        super().__init__(f"Pod template {template!r}, {where}: {problem}")
        self.template, self.line, self.problem = template, line, problem


class ManifestRefused(ValueError):
    """A rendered manifest the Kubernetes schema refuses; `path` is where in it."""

    def __init__(self, problem: str, path: tuple[str | int, ...]) -> None:
        super().__init__(f"{'.'.join(str(step) for step in path) or 'the manifest'}: {problem}")
        self.problem, self.path = problem, path


@dataclass(frozen=True)
class ClusterSettings:
    """What rendering needs to know of the cluster and the pool (the agent's configuration)."""

    namespace: str = "default"
    agent: str = "klique-agent"  # this agent's label value: its objects carry it
    gpu_resource: str = "nvidia.com/gpu"  # amd.com/gpu on AMD clusters
    shared_gpu_resource: str = "nvidia.com/gpu.shared"  # the device plugin's time-sliced GPUs
    local_queue: str = ""  # Kueue's LocalQueue for this pool's Jobs; "" where Kueue is not used
    ttl_seconds_after_finished: int = 3600
    default_image: str = "python:3.11-slim"
    shared_path: str = ""  # the shared file system's path, the same on every pool
    shared_volume: Mapping[str, Any] = field(default_factory=dict)  # its volume source, e.g. a PVC
    work_volume: Mapping[str, Any] = field(default_factory=dict)  # where outputs are written; the agent
    # mounts the same volume, so it can upload them. Without one, outputs cannot be collected.
    scratch_size: str = ""  # the emptyDir's sizeLimit, e.g. "100Gi"; "" for none
    volumes: Mapping[str, task_volumes.Offered] = field(default_factory=dict)  # what a task may declare
    multi_node: str = "indexed-job"  # the workload of a multi-node task, one of MULTI_NODE_KINDS
    app_network_policy: bool = True  # an app's pod admits connections to its relay's port only


# Parsing -------------------------------------------------------------------------------------------------


class _NoAliases(yaml.SafeLoader):
    """SafeLoader that refuses anchors and aliases: the billion-laughs expansion has no way in."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise yaml.MarkedYAMLError(
                problem="anchors and aliases (& and *) are not allowed in a pod template",
                problem_mark=event.start_mark,
            )
        return super().compose_node(parent, index)


@dataclass(frozen=True)
class Template:
    """A parsed pod template: its YAML nodes, kept with their lines, so every error can name one."""

    name: str
    root: yaml.MappingNode

    @classmethod
    def parse(cls, name: str, text: str) -> Template:
        if len(text.encode()) > MAX_TEMPLATE_BYTES:
            raise PodTemplateInvalid(name, None, f"it is over {MAX_TEMPLATE_BYTES // 1024} KiB.")
        try:
            root = yaml.compose(text, Loader=_NoAliases)
        except yaml.MarkedYAMLError as error:
            line = error.problem_mark.line + 1 if error.problem_mark else None
            raise PodTemplateInvalid(name, line, f"it is not valid YAML: {error.problem}.") from None
        except yaml.YAMLError as error:
            raise PodTemplateInvalid(name, None, f"it is not valid YAML: {error}.") from None
        if root is None:
            root = yaml.compose(DEFAULT_TEMPLATE, Loader=_NoAliases)
        if not isinstance(root, yaml.MappingNode):
            line = root.start_mark.line + 1 if root is not None else None
            raise PodTemplateInvalid(name, line, "it must be a mapping with metadata and spec.")
        template = cls(name, root)
        unknown = sorted(set(_placeholders(root)) - set(VARIABLES))
        if unknown:
            line, variable = min(
                (line, variable) for variable, line in _placeholders(root).items() if variable in unknown
            )
            raise PodTemplateInvalid(
                name, line, f"unknown variable ${{{variable}}}; it may use {', '.join(sorted(VARIABLES))}."
            )
        built, _ = template.render(dict.fromkeys(VARIABLES, "0"))
        for key in built:
            if key not in ("metadata", "spec"):
                raise PodTemplateInvalid(
                    name, template.line(key), f"{key!r} is not part of a pod template (metadata, spec)."
                )
        if not isinstance(built.get("spec") or {}, dict) or not isinstance(built.get("metadata") or {}, dict):
            raise PodTemplateInvalid(name, None, "metadata and spec must be mappings.")
        return template

    def line(self, *path: str | int) -> int:
        """The template's line of the deepest node on the path that it has (1 for the top)."""
        node: yaml.Node = self.root
        for step in path:
            if isinstance(node, yaml.MappingNode) and isinstance(step, str):
                found = next((value for key, value in node.value if key.value == step), None)
            elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
                found = node.value[step]
            else:
                found = None
            if found is None:
                break
            node = found
        return int(node.start_mark.line) + 1

    def render(self, values: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, int]]:
        """The template as data, its placeholders replaced; and the line of each placeholder used."""
        used: dict[str, int] = {}
        built = _build(self.name, self.root, values, used)
        return (built if isinstance(built, dict) else {}), used


def _placeholders(node: yaml.Node, found: dict[str, int] | None = None) -> dict[str, int]:
    found = {} if found is None else found
    if isinstance(node, yaml.ScalarNode):
        for match in PLACEHOLDER.finditer(str(node.value)):
            if match.group(2):
                found.setdefault(match.group(2), node.start_mark.line + 1)
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            _placeholders(key, found)
            _placeholders(value, found)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _placeholders(item, found)
    return found


_SCALARS = yaml.SafeLoader("")  # constructs plain scalars (ints, bools, nulls) as YAML 1.1 reads them


def _build(name: str, node: yaml.Node, values: Mapping[str, str], used: dict[str, int]) -> Any:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        built: dict[str, Any] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                raise PodTemplateInvalid(name, key.start_mark.line + 1, "keys must be plain text.")
            key_text = str(key.value)
            if key_text in built:
                raise PodTemplateInvalid(name, key.start_mark.line + 1, f"{key_text!r} is given twice.")
            if key_text == "<<":
                raise PodTemplateInvalid(name, key.start_mark.line + 1, "merge keys (<<) are not allowed.")
            built[key_text] = _build(name, value, values, used)
        return built
    if isinstance(node, yaml.SequenceNode):
        return [_build(name, item, values, used) for item in node.value]
    assert isinstance(node, yaml.ScalarNode)
    if node.tag != "tag:yaml.org,2002:str":
        try:
            return _SCALARS.construct_object(node)
        except yaml.constructor.ConstructorError as error:
            raise PodTemplateInvalid(name, line, f"{error.problem}.") from None

    def replace(match: re.Match[str]) -> str:
        if match.group(1) == "${":
            return "${"
        variable = match.group(2)
        used.setdefault(variable, line)
        if variable not in values:
            raise PodTemplateInvalid(
                name, line, f"unknown variable ${{{variable}}}; it may use {', '.join(sorted(VARIABLES))}."
            )
        return str(values[variable])

    return PLACEHOLDER.sub(replace, str(node.value))


# Rendering -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Relay:
    """An app's relay beside it in its pod: the image it runs from (the agent's own), the port it takes
    callers on, the app's port on the pod's loopback, and the run's key."""

    image: str
    port: int
    app_port: int
    key: str


def relay_ports(pod_spec: Mapping[str, Any]) -> tuple[int, int] | None:
    """The relay's and the app's ports as a pod's relay sidecar was given them; None for a pod without one
    (or one whose command is not the one `Relay` renders)."""
    for container in pod_spec.get("initContainers") or []:
        if not isinstance(container, dict) or container.get("name") != RELAY_CONTAINER:
            continue
        words = [str(word) for word in container.get("command") or []]
        if len(words) == 6 and words[:3] == ["klique-node", "relay", "--port"] and words[4] == "--app-port":
            found = [int(word) for word in (words[3], words[5]) if word.isdigit()]
            if len(found) == 2 and all(1 <= port <= 65535 for port in found):
                return found[0], found[1]
    return None


def app_objects_name(job: str) -> str:
    """The name of an app run's own Secret (its relay's key: beside the run's, which the app's container
    reads whole) and NetworkPolicy."""
    return f"{job}-app"


@dataclass(frozen=True)
class Manifests:
    job: dict[str, Any]  # the workload: a batch/v1 Job, or for a multi-node task a JobSet or PyTorchJob
    secret: dict[str, Any]
    service: dict[str, Any] | None  # a multi-node Indexed Job's headless Service (the others make theirs)
    app_secret: dict[str, Any] | None = None  # an app's relay key (Relay), for its sidecar alone
    app_policy: dict[str, Any] | None = None  # an app's NetworkPolicy: its pod takes in its relay's port only
    cluster: dict[str, Any] | None = None  # a clustering service's cluster (protocol.clusters), made first
    # A Slurm cluster's controller: the Secret of its files and the Service its workers reach it by.
    cluster_objects: tuple[dict[str, Any], ...] = ()

    @property
    def kind(self) -> str:
        return str(self.job["kind"])

    def beside(self) -> list[tuple[dict[str, Any], str]]:
        """What is made before the workload (after its Secret) and owned by it, each with its resource's
        name, in the order made."""
        made = [
            (self.app_secret, "secrets"),
            (self.service, "services"),
            (self.app_policy, "networkpolicies.networking.k8s.io"),
            (self.cluster, f"{clusters.K3K_PLURAL}.{clusters.K3K_GROUP}"),
            *((item, str(item["kind"]).lower() + "s") for item in self.cluster_objects),
        ]
        return [(item, resource) for item, resource in made if item is not None]

    @property
    def followed(self) -> str:
        """What the task's pods are grouped by: the Job's name (the workload, or the JobSet's one Job), or
        the PyTorchJob's, whose pods the operator makes without a Job."""
        return followed_job(self.kind, self.job["metadata"]["name"])


def followed_job(kind: str, name: str) -> str:
    """The Job that runs a workload of `kind` named `name` (a PyTorchJob's own name: its pods carry it)."""
    return f"{name}-{JOBSET_REPLICATED}-0" if kind == "JobSet" else name


def rendezvous_host(kind: str, name: str, namespace: str) -> str:
    """Rank 0's DNS name: `<job>-0.<service>` for an Indexed Job, `<jobset>-node-0-0.<jobset>` on JobSet."""
    return f"{followed_job(kind, name)}-0.{name}.{namespace}.svc"


def job_name(task_id: str, lease_id: str) -> str:
    """`k-<task>-<lease>`: one name per run, at most 52 characters, a DNS label (Service names too)."""
    task = NAME_PIECE.sub("", task_id.lower())[:36] or "task"
    lease = NAME_PIECE.sub("", lease_id.lower())[:8] or "0"
    return f"k-{task}-{lease}".strip("-")


def label_value(text: str) -> str:
    """Text as a label value: at most 63 of letters, digits, `-_.`, starting and ending alphanumeric."""
    cleaned = LABEL_VALUE.sub("-", text)[:63]
    return cleaned.strip("-_.")


def gpus_per_node(assignment: Mapping[str, Any]) -> tuple[int, int]:
    """(units per node, nodes) of the task's size; a size that does not split evenly over its nodes is
    refused, as the batch systems refuse it."""
    units, nodes = int(assignment.get("size_units") or 0), max(1, int(assignment.get("nodes") or 1))
    if nodes > 1 and units % (UNITS_PER_GPU * nodes):
        raise ValueError(
            f"{units / UNITS_PER_GPU:g} GPUs do not split evenly over {nodes} nodes in whole GPUs."
        )
    return units // nodes, nodes


def gpu_limits(assignment: Mapping[str, Any], settings: ClusterSettings) -> tuple[dict[str, str], str]:
    """The container's GPU limits for the task's size, and the memory fraction of a shared GPU ("" else).

    Whole GPUs are `gpu_resource: N`; a MIG slice is `nvidia.com/mig-<profile>: 1`; a fraction of a GPU is
    one `shared_gpu_resource` (the NVIDIA device plugin's time-sliced GPU, renamed `.shared`), with the
    share in KLIQUE_GPU_MEMORY_FRACTION for frameworks that cap their memory, as on bare metal."""
    units, _ = gpus_per_node(assignment)
    if units <= 0:
        return {}, ""
    if assignment.get("sharing") == "mig" and assignment.get("mig_profile"):
        profile = str(assignment["mig_profile"]).lower()
        if not re.fullmatch(r"[0-9]+g\.[0-9]+gb(\+[a-z]+)?", profile):
            raise ValueError(f"MIG profile {profile!r} is not one Kubernetes names (like 1g.10gb).")
        return {f"nvidia.com/mig-{profile}": "1"}, ""
    if units % UNITS_PER_GPU:
        return {settings.shared_gpu_resource: "1"}, f"{units / UNITS_PER_GPU:.4f}"
    return {settings.gpu_resource: str(units // UNITS_PER_GPU)}, ""


def values_for(assignment: Mapping[str, Any], settings: ClusterSettings) -> dict[str, str]:
    spec = assignment.get("spec") or {}
    units, nodes = gpus_per_node(assignment)
    return {
        "task_id": str(assignment["task_id"]),
        "task_name": str(assignment.get("name") or ""),
        "job_name": job_name(str(assignment["task_id"]), str(assignment.get("lease_id") or "")),
        "namespace": settings.namespace,
        "lease_id": str(assignment.get("lease_id") or ""),
        "user": str(assignment.get("user") or ""),
        "project": str(assignment.get("project") or ""),
        "compute_resource": str(assignment.get("compute_resource") or ""),
        "image": str(spec.get("image") or settings.default_image),
        "gpus": f"{units / UNITS_PER_GPU:g}",
        "nodes": str(nodes),
    }


def render(
    template: Template,
    assignment: Mapping[str, Any],
    settings: ClusterSettings,
    *,
    tenant: str = "",
    environment: Mapping[str, str] | None = None,
    relay: Relay | None = None,
) -> Manifests:
    """The Job, Secret and Service of one run of the task. `environment` is the task's variables and
    secrets, checked by the caller: they go into the Secret only. An app's run has its `relay` beside it.
    Raises PodTemplateInvalid."""
    try:
        values = values_for(assignment, settings)
        cluster_limits, fraction = gpu_limits(assignment, settings)
        service = _cluster_service(assignment) if relay is not None else None
    except ValueError as error:
        raise PodTemplateInvalid(template.name, None, str(error)) from None
    # A K3k cluster's GPUs are its agents', not the app's own pod's (a Slurm cluster's workers are tasks).
    k3k = service is not None and service.service == "k3k"
    limits, fraction = ({}, "") if k3k else (cluster_limits, fraction)
    _, nodes = gpus_per_node(assignment)
    pod = copy.deepcopy(template.render(values)[0])
    name = values["job_name"]
    labels = {
        "app.kubernetes.io/managed-by": "klique",
        "klique.io/agent": label_value(settings.agent),
        "klique.io/task": label_value(values["task_id"]),
        "klique.io/lease": label_value(values["lease_id"]),
        "klique.io/tenant": label_value(tenant),
        "klique.io/submitter": label_value(values["user"]),
        **_worker_label(assignment),
    }
    annotations = {
        "klique.io/task-name": values["task_name"][:1000],
        "klique.io/submitter": values["user"],
        "klique.io/compute-resource": values["compute_resource"],
        "klique.io/project": values["project"],
    }
    outputs = (assignment.get("spec") or {}).get("outputs") or []
    if outputs:  # what the agent uploads from the task's folder when it ends, also after a restart
        annotations["klique.io/outputs"] = json.dumps([str(pattern) for pattern in outputs])
    if relay is not None:  # the app's section (no secret in it), for an agent that adopts the run
        annotations[APP_ANNOTATION] = json.dumps((assignment.get("spec") or {}).get("app"))
    metadata = _mapping(pod, "metadata")
    metadata["labels"] = {**(metadata.get("labels") or {}), **labels}
    metadata["annotations"] = {**(metadata.get("annotations") or {}), **annotations}
    spec = _mapping(pod, "spec")
    spec["restartPolicy"] = "Never"
    on_jobset = nodes > 1 and settings.multi_node == "jobset"
    on_pytorchjob = nodes > 1 and settings.multi_node == "pytorchjob"
    if nodes > 1 and not on_pytorchjob:
        spec["subdomain"] = name  # pods are <job>-<index>.<name>: the headless Service's names
    containers = _listed(spec, "containers")
    if not containers:
        containers.append({"name": MAIN_CONTAINER, "image": values["image"]})
    index = next((at for at, item in enumerate(containers) if item.get("name") == MAIN_CONTAINER), 0)
    _check_gpus(template, ("spec", "containers", index), containers[index], limits)
    # The training operator sets the rendezvous variables of a PyTorchJob itself.
    master = (
        "" if on_pytorchjob else rendezvous_host("JobSet" if on_jobset else "Job", name, settings.namespace)
    )
    _main_container(containers[index], assignment, values, limits, fraction=fraction, master=master)
    if on_pytorchjob:
        containers[index]["name"] = PYTORCH_CONTAINER
    try:
        declared = task_volumes.chosen(
            task_volumes.wanted((assignment.get("spec") or {}).get("volumes")), settings.volumes
        )
    except task_volumes.VolumeRefused as error:
        raise PodTemplateInvalid(template.name, None, str(error)) from None
    _volumes(spec, containers[index], values["task_id"], settings, declared)
    app_secret = (
        _add_relay(template, spec, relay, name=name, labels=labels, settings=settings, nodes=nodes)
        if relay
        else None
    )
    cluster, slurm = _cluster_parts(
        template, service, assignment, spec, containers[index], name=name, labels=labels,
        limits=cluster_limits, settings=settings,
    )  # fmt: skip
    job = _job(pod, name, labels, annotations, nodes=nodes, settings=settings)
    if on_jobset:
        job = _jobset(job, settings)
    elif on_pytorchjob:
        job = _pytorchjob(job, nodes, settings)
    return Manifests(
        job=job,
        secret={
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": settings.namespace, "labels": labels},
            "type": "Opaque",
            "stringData": dict(environment or {}),
        },
        service=_service(name, labels, settings) if nodes > 1 and job["kind"] == "Job" else None,
        app_secret=app_secret,
        app_policy=_app_policy(name, labels, relay, settings, slurm=bool(slurm))
        if relay and settings.app_network_policy
        else None,
        cluster=cluster,
        cluster_objects=slurm,
    )


def _cluster_service(assignment: Mapping[str, Any]) -> clusters.ClusterService | None:
    """The app's cluster section, where it is a clustering service; ValueError where it is wrong."""
    section = ((assignment.get("spec") or {}).get("app") or {}).get("cluster")
    if section is None:
        return None
    try:
        return clusters.ClusterService.parse(section)
    except clusters.ServiceInvalid as error:
        raise ValueError(f"the app's cluster cannot be made: {error}") from None


def _with_cluster(
    template: Template,
    service: clusters.ClusterService | None,
    spec: dict[str, Any],
    main: dict[str, Any],
    *,
    name: str,
    labels: Mapping[str, str],
    limits: Mapping[str, str],
    settings: ClusterSettings,
) -> dict[str, Any] | None:
    """The run's cluster (None for an app that makes none), with the task's GPUs split over its workers;
    the app's container gets the kubeconfig the agent mints for it once the cluster is ready (the pod
    starts when that Secret exists)."""
    if service is None:
        return None
    if any(GPU_RESOURCE.fullmatch(resource) and resource != settings.gpu_resource for resource in limits):
        problem = (
            "a cluster's GPUs are whole GPUs; a fraction or a MIG slice cannot be split over its workers"
        )
        raise PodTemplateInvalid(template.name, None, problem)
    gpus = int(limits.get(settings.gpu_resource) or 0)
    if gpus % service.agents:
        problem = f"{gpus} GPUs do not split evenly over the cluster's {service.agents} agents"
        raise PodTemplateInvalid(template.name, None, problem)
    volume = f"klique-{clusters.K3K_KIND.lower()}"
    _listed(spec, "volumes").append(
        {"name": volume, "secret": {"secretName": clusters.kubeconfig_secret(name), "defaultMode": 0o400}}
    )
    _listed(main, "volumeMounts").append(
        {"name": volume, "mountPath": clusters.KUBECONFIG_PATH, "readOnly": True}
    )
    main["env"] = [
        *(item for item in _listed(main, "env") if item.get("name") != "KUBECONFIG"),
        {"name": "KUBECONFIG", "value": f"{clusters.KUBECONFIG_PATH}/{clusters.KUBECONFIG_KEY}"},
    ]
    return clusters.k3k_cluster(
        service,
        job=name,
        namespace=settings.namespace,
        gpus=gpus,
        gpu_resource=settings.gpu_resource,
        labels=labels,
        pod_spec=spec,
    )


def _app_policy(
    name: str, labels: Mapping[str, str], relay: Relay, settings: ClusterSettings, *, slurm: bool = False
) -> dict[str, Any]:
    """The app's pod admits connections to its relay's port and nothing else, from anywhere (the agent
    may run outside the cluster): an app that listens on the pod's network as well as its loopback is
    still reached through the relay only, where the cluster's network plugin enforces policies."""
    run = {key: labels[key] for key in ("klique.io/agent", "klique.io/task", "klique.io/lease")}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": app_objects_name(name), "namespace": settings.namespace, "labels": dict(labels)},
        "spec": {
            "podSelector": {"matchLabels": run},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": relay.port}]},
                # A Slurm controller takes in its own workers, on any port (slurmd calls srun back).
                *(
                    [
                        {
                            "from": [
                                {
                                    "podSelector": {
                                        "matchLabels": {SLURM_CLUSTER_LABEL: clusters.cluster_name(name)}
                                    }
                                }
                            ]
                        }
                    ]
                    if slurm
                    else []
                ),
            ],
        },
    }


SLURM_CLUSTER_LABEL = "klique.io/slurm-cluster"


def _cluster_parts(
    template: Template,
    service: clusters.ClusterService | None,
    assignment: Mapping[str, Any],
    spec: dict[str, Any],
    main: dict[str, Any],
    *,
    name: str,
    labels: Mapping[str, str],
    limits: Mapping[str, str],
    settings: ClusterSettings,
) -> tuple[dict[str, Any] | None, tuple[dict[str, Any], ...]]:
    """A K3k cluster's object, or a Slurm controller's objects, made beside the app; a Slurm worker's pod
    made its node."""
    _slurm_worker(template, assignment, spec, main, settings)
    if service is None:
        return None, ()
    if service.service == "slurm":
        return None, _slurm_controller(
            service, assignment, spec, main, name=name, labels=labels, settings=settings
        )
    k3k = _with_cluster(
        template, service, spec, main, name=name, labels=labels, limits=limits, settings=settings
    )
    return k3k, ()


def _worker_label(assignment: Mapping[str, Any]) -> dict[str, str]:
    """A Slurm worker's pod carries its cluster's name: its controller takes connections from it."""
    worker = (assignment.get("spec") or {}).get(clusters.WORKER_SECTION)
    if not isinstance(worker, dict) or not isinstance(worker.get("node"), str):
        return {}
    return {SLURM_CLUSTER_LABEL: label_value(worker["node"].rpartition("-w")[0])}


def _slurm_controller(
    service: clusters.ClusterService,
    assignment: Mapping[str, Any],
    spec: dict[str, Any],
    main: dict[str, Any],
    *,
    name: str,
    labels: Mapping[str, str],
    settings: ClusterSettings,
) -> tuple[dict[str, Any], ...]:
    """A Slurm cluster's controller: the app's pod, under the controller's host name, with the cluster's
    files; the Secret of those files (a new munge key: one made before for this run is kept by the agent)
    and the Service its workers reach slurmctld by."""
    try:
        files = clusters.slurm_files(
            service,
            job=name,
            plane=str(assignment.get("plane_url") or ""),
            task_id=str(assignment.get("task_id") or ""),
            token=str(assignment.get("task_token") or ""),
        )
    except ValueError as error:
        raise PodTemplateInvalid("slurm", None, str(error)) from None
    spec["hostname"] = clusters.slurm_controller(name)
    _mount_slurm(spec, main, clusters.slurm_secret(name))
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": clusters.slurm_secret(name),
            "namespace": settings.namespace,
            "labels": dict(labels),
        },
        "type": "Opaque",
        "stringData": files,
        "data": {"munge.key": base64.b64encode(secrets.token_bytes(clusters.MUNGE_KEY_BYTES)).decode()},
    }
    run = {key: labels[key] for key in ("klique.io/agent", "klique.io/task", "klique.io/lease")}
    controller = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": clusters.slurm_controller(name),
            "namespace": settings.namespace,
            "labels": dict(labels),
        },
        "spec": {
            "selector": run,
            "publishNotReadyAddresses": True,
            "ports": [{"name": "slurmctld", "protocol": "TCP", "port": clusters.SLURMCTLD_PORT}],
        },
    }
    return secret, controller


def _mount_slurm(spec: dict[str, Any], main: dict[str, Any], secret: str) -> None:
    _listed(spec, "volumes").append(
        {"name": "klique-slurm", "secret": {"secretName": secret, "defaultMode": 0o500}}
    )
    _listed(main, "volumeMounts").append(
        {"name": "klique-slurm", "mountPath": clusters.SLURM_PATH, "readOnly": True}
    )


def _slurm_worker(
    template: Template,
    assignment: Mapping[str, Any],
    spec: dict[str, Any],
    main: dict[str, Any],
    settings: ClusterSettings,
) -> None:
    """A Slurm cluster's worker task: its pod is its node (host name, the cluster's label) with the
    controller run's files, its CPUs asked for as Slurm counts them, and the controller's folder on the
    work volume at the controller's path: a job runs in the folder it was submitted from, and its output
    is written there, for the login to read."""
    section = (assignment.get("spec") or {}).get(clusters.WORKER_SECTION)
    if section is None:
        return
    try:
        worker = clusters.SlurmWorker.parse(section)
    except ValueError as error:
        raise PodTemplateInvalid(template.name, None, str(error)) from None
    spec["hostname"] = worker.node
    _mount_slurm(spec, main, worker.secret)
    requests = _mapping(_mapping(main, "resources"), "requests")
    requests.setdefault("cpu", str(worker.cpus))
    if settings.work_volume:
        folder = {
            "name": "klique-work",
            "mountPath": f"{WORK_PATH}/{worker.controller}",
            "subPath": worker.controller,
        }
        _listed(main, "volumeMounts").append(folder)


def _add_relay(
    template: Template,
    spec: dict[str, Any],
    relay: Relay,
    *,
    name: str,
    labels: Mapping[str, str],
    settings: ClusterSettings,
    nodes: int,
) -> dict[str, Any]:
    """The app's relay into the pod spec; the Secret that holds its key."""
    if nodes > 1:
        raise PodTemplateInvalid(template.name, None, "an app runs on one node; its size asks for more")
    if any(item.get("name") == RELAY_CONTAINER for item in _listed(spec, "initContainers")):
        where = template.line("spec", "initContainers")
        problem = f"no init container may be named {RELAY_CONTAINER!r}: that is an app's relay"
        raise PodTemplateInvalid(template.name, where, problem)
    spec["initContainers"].append(_relay_container(relay, name))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": app_objects_name(name), "namespace": settings.namespace, "labels": dict(labels)},
        "type": "Opaque",
        "stringData": {"key": relay.key},
    }


def _relay_container(relay: Relay, job: str) -> dict[str, Any]:
    """The app's relay as a native sidecar: started before the app (once its port takes connections),
    running beside it, stopped after it."""
    key = {"secretKeyRef": {"name": app_objects_name(job), "key": "key"}}
    command = ["klique-node", "relay", "--port", str(relay.port), "--app-port", str(relay.app_port)]
    return {
        "name": RELAY_CONTAINER,
        "image": relay.image,
        "restartPolicy": "Always",
        "command": command,
        "env": [{"name": APP_KEY_VARIABLE, "valueFrom": key}],
        "ports": [{"name": "klique-relay", "containerPort": relay.port, "protocol": "TCP"}],
        "startupProbe": {"tcpSocket": {"port": relay.port}, "periodSeconds": 1, "failureThreshold": 60},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RELAY_USER,
            "runAsGroup": RELAY_USER,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def _mapping(parent: dict[str, Any], key: str) -> dict[str, Any]:
    value = parent.get(key)
    parent[key] = value if isinstance(value, dict) else {}
    return parent[key]  # type: ignore[no-any-return]


def _listed(parent: dict[str, Any], key: str) -> list[Any]:
    value = parent.get(key)
    parent[key] = value if isinstance(value, list) else []
    return parent[key]  # type: ignore[no-any-return]


def _main_container(
    main: dict[str, Any],
    assignment: Mapping[str, Any],
    values: Mapping[str, str],
    limits: Mapping[str, str],
    *,
    fraction: str,
    master: str,
) -> None:
    """The task's command, its GPUs, Klique's variables and the task's Secret in the task's container;
    `master` is rank 0's address for a multi-node task, "" where the training operator sets the rendezvous
    variables itself."""
    main.setdefault("image", values["image"])
    command = (assignment.get("spec") or {}).get("command")
    if command:
        main["command"] = [str(word) for word in command]
        main.pop("args", None)
    resources = _mapping(main, "resources")
    resources["limits"] = {**(resources.get("limits") or {}), **limits}
    if resources.get("requests"):
        resources["requests"] = {**resources["requests"], **limits}
    task_id, name, nodes = values["task_id"], values["job_name"], int(values["nodes"])
    klique_env: list[dict[str, Any]] = [
        {"name": "KLIQUE_TASK_ID", "value": task_id},
        {"name": "KLIQUE_WORK_DIR", "value": f"{WORK_PATH}/{task_id}"},
        {"name": "KLIQUE_SCRATCH_DIR", "value": SCRATCH_PATH},
    ]
    if fraction:
        klique_env.append({"name": "KLIQUE_GPU_MEMORY_FRACTION", "value": fraction})
    if nodes > 1 and not master:
        klique_env.append({"name": "KLIQUE_GPUS_PER_NODE", "value": values["gpus"]})
    elif nodes > 1:
        rank = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}
        klique_env += [
            {"name": "WORLD_SIZE", "value": str(nodes)},
            {"name": "RANK", "valueFrom": rank},
            {"name": "NODE_RANK", "valueFrom": rank},
            {"name": "MASTER_ADDR", "value": master},
            {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
            {"name": "KLIQUE_GPUS_PER_NODE", "value": values["gpus"]},
        ]
    ours = {variable["name"] for variable in klique_env}
    # The template's own variables stay, but not under Klique's names; env overrides envFrom.
    main["env"] = [item for item in _listed(main, "env") if item.get("name") not in ours] + klique_env
    main["envFrom"] = [*_listed(main, "envFrom"), {"secretRef": {"name": name}}]


def _volumes(
    spec: dict[str, Any],
    main: dict[str, Any],
    task_id: str,
    settings: ClusterSettings,
    declared: list[tuple[task_volumes.Offered, bool]],
) -> None:
    """Scratch, the task's folder on the work volume, the shared file system at its usual path, and the
    volumes the task declared out of those the pool offers."""
    mounts, volumes = _listed(main, "volumeMounts"), _listed(spec, "volumes")
    mounts.append({"name": "klique-scratch", "mountPath": SCRATCH_PATH})
    scratch: dict[str, Any] = {"sizeLimit": settings.scratch_size} if settings.scratch_size else {}
    volumes.append({"name": "klique-scratch", "emptyDir": scratch})
    if settings.work_volume:
        mounts.append({"name": "klique-work", "mountPath": f"{WORK_PATH}/{task_id}", "subPath": task_id})
        volumes.append({"name": "klique-work", **copy.deepcopy(dict(settings.work_volume))})
        main.setdefault("workingDir", f"{WORK_PATH}/{task_id}")
    if settings.shared_path and settings.shared_volume:
        mounts.append({"name": "klique-shared", "mountPath": settings.shared_path})
        volumes.append({"name": "klique-shared", **copy.deepcopy(dict(settings.shared_volume))})
    for offer, read_only in declared:
        mounts.append({"name": f"klique-v-{offer.name}", "mountPath": offer.path, "readOnly": read_only})
        volumes.append({"name": f"klique-v-{offer.name}", **copy.deepcopy(dict(offer.source))})


def _job(
    pod: dict[str, Any],
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    *,
    nodes: int,
    settings: ClusterSettings,
) -> dict[str, Any]:
    job_labels = dict(labels)
    spec: dict[str, Any] = {
        "backoffLimit": 0,  # a failed attempt is the plane's to retry, on whichever pool
        "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
        "template": pod,
    }
    if nodes > 1:
        spec.update(completionMode="Indexed", completions=nodes, parallelism=nodes)
    if settings.local_queue:
        job_labels["kueue.x-k8s.io/queue-name"] = settings.local_queue
        spec["suspend"] = True  # Kueue admits it when the queue's quota allows
    metadata = {
        "name": name,
        "namespace": settings.namespace,
        "labels": job_labels,
        "annotations": annotations,
    }
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


def _jobset(job: Mapping[str, Any], settings: ClusterSettings) -> dict[str, Any]:
    """The Indexed Job of a multi-node task inside a JobSet of one replicated Job. The Job keeps Klique's
    labels (the JobSet controller copies them onto the Job it makes, and the pod template's onto the pods),
    so the agent follows it as it follows any Job of its own; Kueue's queue, suspension and the TTL move to
    the JobSet, which Kueue admits as one workload."""
    metadata = copy.deepcopy(dict(job["metadata"]))
    name = metadata["name"]
    inner_labels = {k: v for k, v in metadata["labels"].items() if k != "kueue.x-k8s.io/queue-name"}
    inner_spec = {
        key: copy.deepcopy(value)
        for key, value in job["spec"].items()
        if key not in ("ttlSecondsAfterFinished", "suspend")
    }
    spec: dict[str, Any] = {
        "replicatedJobs": [
            {
                "name": JOBSET_REPLICATED,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": inner_labels, "annotations": dict(metadata["annotations"])},
                    "spec": inner_spec,
                },
            }
        ],
        "failurePolicy": {"maxRestarts": 0},  # a failed attempt is the plane's to retry
        "successPolicy": {"operator": "All"},
        "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
        "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
    }
    if settings.local_queue:
        spec["suspend"] = True  # Kueue admits the whole JobSet when the queue's quota allows
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": metadata, "spec": spec}


def _pytorchjob(job: Mapping[str, Any], nodes: int, settings: ClusterSettings) -> dict[str, Any]:
    """The multi-node task as the training operator's PyTorchJob: a Master and nodes - 1 Workers of the same
    pod. Nothing restarts: a failed attempt is the plane's to retry. Kueue's queue and suspension are on the
    PyTorchJob, which Kueue admits as one workload."""
    metadata = copy.deepcopy(dict(job["metadata"]))
    pod = job["spec"]["template"]

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "Never", "template": copy.deepcopy(pod)}

    run_policy: dict[str, Any] = {
        "cleanPodPolicy": "None",  # finished pods stay for their logs; the PyTorchJob's TTL takes them
        "backoffLimit": 0,
        "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
    }
    if settings.local_queue:
        run_policy["suspend"] = True
    spec = {
        "runPolicy": run_policy,
        "pytorchReplicaSpecs": {"Master": replicas(1), "Worker": replicas(nodes - 1)},
    }
    return {"apiVersion": PYTORCHJOB_API, "kind": "PyTorchJob", "metadata": metadata, "spec": spec}


PYTORCHJOB_SPEC_FIELDS = frozenset({"runPolicy", "pytorchReplicaSpecs"})


def validate_pytorchjob(job: Mapping[str, Any], version: str = KUBERNETES_VERSION) -> None:
    """A PyTorchJob as Klique makes it: its envelope checked here, each replica's pod template against the
    Kubernetes schema (inside a Job, as a pod template is checked). Raises ManifestRefused with the path."""
    spec = _envelope(job, PYTORCHJOB_API, "PyTorchJob", PYTORCHJOB_SPEC_FIELDS)
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if set(replicas) != {"Master", "Worker"} or (replicas["Master"] or {}).get("replicas") != 1:
        raise ManifestRefused("one Master and the Workers", ("spec", "pytorchReplicaSpecs"))
    name = str((job.get("metadata") or {}).get("name") or "")
    _dns_label(f"{name}-worker-{max(0, int(replicas['Worker'].get('replicas') or 0) - 1)}")
    for role in ("Master", "Worker"):
        template = replicas[role].get("template") or {}
        containers = (template.get("spec") or {}).get("containers") or []
        if not any(container.get("name") == PYTORCH_CONTAINER for container in containers):
            raise ManifestRefused(
                f"the task's container is named {PYTORCH_CONTAINER!r}", ("spec", "pytorchReplicaSpecs", role)
            )
        wrapped = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{name}-{role.lower()}"[:63]},
            "spec": {"template": template},
        }
        try:
            validate(wrapped, version)
        except ManifestRefused as refused:
            raise ManifestRefused(
                refused.problem, ("spec", "pytorchReplicaSpecs", role, "template", *refused.path[2:])
            ) from None


def validate_workload(manifest: Mapping[str, Any], version: str = KUBERNETES_VERSION) -> None:
    """Any manifest Klique makes, each by its own rule."""
    checks = {"JobSet": validate_jobset, "PyTorchJob": validate_pytorchjob, clusters.K3K_KIND: _validate_k3k}
    checks.get(str(manifest.get("kind")), validate)(manifest, version)


def _validate_k3k(manifest: Mapping[str, Any], version: str = KUBERNETES_VERSION) -> None:
    try:
        clusters.validate_k3k(manifest)
    except clusters.ManifestInvalid as invalid:
        raise ManifestRefused(invalid.problem, invalid.path) from None


def jobset_job(jobset: Mapping[str, Any]) -> dict[str, Any]:
    """The batch/v1 Job the JobSet controller makes of a JobSet's one replicated Job (its name, the
    template's labels and spec): what is validated against the Kubernetes schema."""
    replicated = jobset["spec"]["replicatedJobs"][0]
    template = replicated["template"]
    name = jobset["metadata"]["name"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": followed_job("JobSet", name),
            "namespace": jobset["metadata"].get("namespace", ""),
            **{
                key: template["metadata"][key]
                for key in ("labels", "annotations")
                if key in template["metadata"]
            },
        },
        "spec": template["spec"],
    }


JOBSET_SPEC_FIELDS = frozenset(
    {"replicatedJobs", "failurePolicy", "successPolicy", "network", "ttlSecondsAfterFinished", "suspend"}
)


def _envelope(manifest: Mapping[str, Any], api: str, kind: str, fields: frozenset[str]) -> Mapping[str, Any]:
    """The spec of a workload of a CRD Klique makes, once its kind and its spec's fields are its own."""
    if manifest.get("apiVersion") != api or manifest.get("kind") != kind:
        raise ManifestRefused(f"not a {api} {kind}", ("kind",))
    spec: Mapping[str, Any] = manifest.get("spec") or {}
    unknown = sorted(set(spec) - fields)
    if unknown:
        raise ManifestRefused(f"unknown fields {', '.join(unknown)}", ("spec",))
    return spec


def _dns_label(name: str) -> None:
    """The longest name a workload gives its pods (their host names, their Services) is a DNS label."""
    if len(name) > 63:
        raise ManifestRefused(f"the pod name {name} is over 63 characters", ("metadata", "name"))


def validate_jobset(jobset: Mapping[str, Any], version: str = KUBERNETES_VERSION) -> None:
    """A JobSet as Klique makes it: its envelope checked here (the schema's own CRD is the cluster's), its
    Job against the Kubernetes schema. Raises ManifestRefused with the path inside the JobSet."""
    spec = _envelope(jobset, JOBSET_API, "JobSet", JOBSET_SPEC_FIELDS)
    replicated = spec.get("replicatedJobs") or []
    if len(replicated) != 1 or replicated[0].get("name") != JOBSET_REPLICATED:
        raise ManifestRefused(f"one replicated Job named {JOBSET_REPLICATED!r}", ("spec", "replicatedJobs"))
    name = str((jobset.get("metadata") or {}).get("name") or "")
    pods_made = int(replicated[0]["template"]["spec"].get("completions") or 1)
    _dns_label(f"{followed_job('JobSet', name)}-{pods_made - 1}")
    try:
        validate(jobset_job(jobset), version)
    except ManifestRefused as refused:
        raise ManifestRefused(
            refused.problem, ("spec", "replicatedJobs", 0, "template", *refused.path)
        ) from None


def _service(name: str, labels: Mapping[str, str], settings: ClusterSettings) -> dict[str, Any]:
    """The headless Service of a multi-node task: `<job>-<index>.<job>` names each pod."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": dict(labels)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # rank 0 is found before every pod is ready
            "selector": {key: labels[key] for key in ("klique.io/task", "klique.io/lease")},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}],
        },
    }


def _check_gpus(
    template: Template, path: tuple[str | int, ...], container: Mapping[str, Any], limits: Mapping[str, str]
) -> None:
    """A template may name the task's GPUs only as the profile counts them."""
    for part in ("limits", "requests"):
        asked = ((container.get("resources") or {}).get(part)) or {}
        for resource, amount in asked.items():
            if GPU_RESOURCE.fullmatch(str(resource)) and str(limits.get(resource)) != str(amount):
                counted = ", ".join(f"{value} {key}" for key, value in limits.items()) or "no GPU"
                raise PodTemplateInvalid(
                    template.name,
                    template.line(*path, "resources", part, str(resource)),
                    f"it asks for {amount} {resource} where the task's profile counts {counted} per node; "
                    "leave GPUs out of the template: Klique sets them from the task's size.",
                )


def validate(manifest: Mapping[str, Any], version: str = KUBERNETES_VERSION) -> None:
    """Check the manifest against the Kubernetes OpenAPI schema (strict: unknown fields are refused).
    Raises ManifestRefused saying where and what."""
    import kubernetes_validate  # noqa: PLC0415 -- the kubernetes extra; loads its schemas on first use

    try:
        kubernetes_validate.validate(dict(manifest), version, strict=True)
    except kubernetes_validate.ValidationError as error:
        raise ManifestRefused(str(error.message), tuple(error.path)) from None


SAMPLE_ASSIGNMENT: dict[str, Any] = {
    "task_id": "00000000-0000-0000-0000-000000000000",
    "lease_id": "00000000-0000-0000-0000-000000000000",
    "name": "sample",
    "size_units": UNITS_PER_GPU,
    "nodes": 1,
    "user": "someone",
    "spec": {"command": ["true"]},
}

SAMPLE_RELAY = Relay(image="klique:sample", port=7070, app_port=8888, key="0" * 64)
SAMPLE_CLUSTER: dict[str, Any] = {
    **SAMPLE_ASSIGNMENT,
    "size_units": 2 * UNITS_PER_GPU,
    "spec": {
        "command": ["true"],
        "app": {"instance": "0" * 8, "port": 8888, "cluster": {"service": "k3k", "agents": 2}},
    },
}


SAMPLE_SLURM: dict[str, Any] = {
    **SAMPLE_ASSIGNMENT,
    "size_units": 0,
    "plane_url": "https://sample.klique.example",
    "task_token": "kqt_sample",
    "spec": {
        "command": ["true"],
        "app": {"instance": "0" * 8, "port": 8888, "cluster": {"service": "slurm", "workers": 2}},
    },
}
_SAMPLE_JOB = job_name(SAMPLE_ASSIGNMENT["task_id"], SAMPLE_ASSIGNMENT["lease_id"])
SAMPLE_SLURM_WORKER: dict[str, Any] = {
    **SAMPLE_ASSIGNMENT,
    "spec": {
        "command": clusters.worker_command(f"{clusters.cluster_name(_SAMPLE_JOB)}-w0", "controller"),
        clusters.WORKER_SECTION: {
            "controller": SAMPLE_ASSIGNMENT["task_id"], "lease": SAMPLE_ASSIGNMENT["lease_id"],
            "node": f"{clusters.cluster_name(_SAMPLE_JOB)}-w0", "secret": clusters.slurm_secret(_SAMPLE_JOB),
            "cpus": 4,
        },
    },
}  # fmt: skip


def check(name: str, text: str, settings: ClusterSettings) -> Template:
    """Parse the template and render it for a sample one-GPU and a sample two-node task, an app, a K3k
    cluster, a Slurm controller and a Slurm worker, each manifest validated against the schema: what the
    agent does with each template before it takes any work.
    Returns the parsed template; raises PodTemplateInvalid naming the line."""
    template = Template.parse(name, text)
    every_volume = {**SAMPLE_ASSIGNMENT["spec"], "volumes": sorted(settings.volumes)}  # each source checked
    two_nodes = {**SAMPLE_ASSIGNMENT, "size_units": 4 * UNITS_PER_GPU, "nodes": 2, "spec": every_volume}
    samples = [
        (SAMPLE_ASSIGNMENT, settings, None),
        (SAMPLE_ASSIGNMENT, settings, SAMPLE_RELAY),
        (SAMPLE_CLUSTER, settings, SAMPLE_RELAY),
        (SAMPLE_SLURM, settings, SAMPLE_RELAY),
        (SAMPLE_SLURM_WORKER, settings, None),
    ] + [(two_nodes, dataclasses.replace(settings, multi_node=kind), None) for kind in MULTI_NODE_KINDS]
    for sample, cluster, relay in samples:
        manifests = render(
            template, sample, cluster, tenant="sample", environment={"SAMPLE": "1"}, relay=relay
        )
        for manifest in (manifests.job, manifests.secret, *(made for made, _ in manifests.beside())):
            try:
                validate_workload(manifest)
            except ManifestRefused as refused:
                path = refused.path
                if manifest is manifests.job and manifest["kind"] == "JobSet":
                    path = path[4:] if path[:4] == ("spec", "replicatedJobs", 0, "template") else ()
                elif manifest is manifests.job and manifest["kind"] == "PyTorchJob":
                    path = (
                        ("spec", "template", *path[4:]) if path[:2] == ("spec", "pytorchReplicaSpecs") else ()
                    )
                if manifest is manifests.job and path[:2] == ("spec", "template"):
                    line = template.line(*path[2:])
                else:
                    line = None
                raise PodTemplateInvalid(
                    name,
                    line,
                    f"the {manifest['kind']} it makes is refused by Kubernetes {KUBERNETES_VERSION}: "
                    f"{refused}.",
                ) from None
    return template
