"""Clustering services: a team's own cluster, made on a Kubernetes pool's nodes as an app of the catalogue.

A template of kind `cluster` carries a `cluster` section (`ClusterService`). Its app runs like any other
(one pod, its relay beside it, reached through its route); the Kubernetes agent also makes the cluster
the section describes, before the app's Job, and deletes it when the run ends. The app's GPUs are the
cluster's, not its own pod's: they are split evenly over the cluster's workers, so the cluster holds
exactly what the scheduler counted for the app.

K3k (`service: "k3k"`): a `k3k.io/v1beta1` Cluster in `virtual` mode, a whole Kubernetes (K3s servers
and agents as pods) on the host cluster's nodes, with a `workerLimit` of the app's GPUs per agent. In
`shared` mode the virtual cluster's pods would be made on the host with whatever GPUs they ask for,
outside the count, so Klique makes virtual clusters only. Once the K3k controller says the cluster is
`Ready`, the agent mints an administrator's client certificate from the cluster's client CA (the
controller's bootstrap Secret) and gives the app's container a kubeconfig for the cluster's API, in a
Secret of the run's own; the shipped entry's container runs `kubectl proxy` on the pod's loopback with
it, so the team reaches its cluster's API through the app's route and only through it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVICES = ("k3k",)
K3K_GROUP, K3K_VERSION, K3K_PLURAL = "k3k.io", "v1beta1", "clusters"
K3K_API = f"{K3K_GROUP}/{K3K_VERSION}"
K3K_KIND = "Cluster"
K3K_VERSION_PATTERN = re.compile(r"v[0-9]{1,2}\.[0-9]{1,3}\.[0-9]{1,3}-k3s[0-9]{1,3}")
PERSISTENCE = ("ephemeral", "dynamic")
SERVERS = (1, 3, 5)  # K3s' embedded etcd keeps a quorum with an odd number
MAX_AGENTS = 64
FIELDS = frozenset({"service", "servers", "agents", "version", "persistence"})
K3K_SPEC_FIELDS = frozenset(
    {"mode", "servers", "agents", "version", "persistence", "tlsSANs", "workerLimit", "nodeSelector",
     "priorityClass"}
)  # fmt: skip
KUBECONFIG_PATH = "/var/run/klique/cluster"  # where the app's container finds the cluster's kubeconfig
KUBECONFIG_KEY = "kubeconfig.yaml"
ADMIN_NAME = "system:admin"  # the client certificate's subject: K3s' administrator,
ADMIN_GROUP = "system:masters"  # in the group Kubernetes gives every right
PHASES_FAILED = ("Failed",)


class ServiceInvalid(ValueError):
    """A `cluster` section with problems, each as "cluster.path: what is wrong"."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class ClusterService:
    service: str = "k3k"
    servers: int = 1
    agents: int = 1
    version: str = ""  # K3s' version (v1.31.3-k3s1); "" is the host cluster's
    persistence: str = "ephemeral"  # the cluster's state dies with it, as a stopped app's does

    @classmethod
    def parse(cls, value: object, *, gpus: str | None = None) -> ClusterService:
        """The section, or ServiceInvalid listing every problem. `gpus` (the template's) must split evenly
        over the agents in whole GPUs."""
        if not isinstance(value, dict):
            raise ServiceInvalid(['cluster: an object {"service": "k3k", "agents": 1, ...}.'])
        problems = [f"cluster.{key}: not a field of a cluster ({', '.join(sorted(FIELDS))})." for key in
                    sorted(set(value) - FIELDS)]  # fmt: skip
        service = value.get("service")
        if service not in SERVICES:
            problems.append(f"cluster.service: one of {', '.join(SERVICES)}.")
        servers = value.get("servers", 1)
        if servers not in SERVERS or isinstance(servers, bool):
            problems.append("cluster.servers: 1, 3 or 5 (K3s servers keep a quorum with an odd number).")
            servers = 1
        agents = value.get("agents", 1)
        if not isinstance(agents, int) or isinstance(agents, bool) or not 1 <= agents <= MAX_AGENTS:
            problems.append(f"cluster.agents: a whole number of worker nodes from 1 to {MAX_AGENTS}.")
            agents = 1
        version = value.get("version", "")
        if not isinstance(version, str) or (version and not K3K_VERSION_PATTERN.fullmatch(version)):
            problems.append('cluster.version: a K3s version, as "v1.31.3-k3s1", or "" for the host\'s.')
            version = ""
        persistence = value.get("persistence", "ephemeral")
        if persistence not in PERSISTENCE:
            problems.append(f"cluster.persistence: one of {', '.join(PERSISTENCE)}.")
            persistence = "ephemeral"
        if gpus is not None:
            whole = gpus.isdigit()
            if not whole or int(gpus) % agents:
                problems.append(
                    f"gpus: a cluster's GPUs are split over its {agents} agents in whole GPUs; {gpus} is not."
                )
        if problems:
            raise ServiceInvalid(problems)
        return cls(str(service), int(servers), int(agents), version, str(persistence))

    def as_json(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "servers": self.servers,
            "agents": self.agents,
            "version": self.version,
            "persistence": self.persistence,
        }


class ManifestInvalid(ValueError):
    def __init__(self, problem: str, path: tuple[str | int, ...]) -> None:
        super().__init__(f"{'.'.join(str(part) for part in path) or '(manifest)'}: {problem}")
        self.problem, self.path = problem, path


# Names -----------------------------------------------------------------------------------------------


def cluster_name(job: str) -> str:
    """The run's cluster: short, as K3k names its objects `k3k-<cluster>-server-0` and the like. The Job's
    name is `k-<task>-<lease>` (protocol.pods.job_name): the lease's piece keeps each run's own."""
    task, _, lease = job.removeprefix("k-").rpartition("-")
    return f"vc-{task.replace('-', '')[:12]}-{lease[:8]}".strip("-")


def kubeconfig_secret(job: str) -> str:
    """The run's Secret with the kubeconfig the agent minted for the app's container."""
    return f"{job}-kubeconfig"


def bootstrap_secret(cluster: str) -> str:
    """The K3k controller's Secret of the cluster's certificate authorities (key `bootstrap`, JSON)."""
    return f"k3k-{cluster}-bootstrap"


def server_host(cluster: str, namespace: str) -> str:
    """The cluster's API inside the host cluster: the K3k controller's Service of its servers, port 443."""
    return f"k3k-{cluster}-service.{namespace}.svc"


# The cluster's manifest ------------------------------------------------------------------------------


def k3k_cluster(
    service: ClusterService,
    *,
    job: str,
    namespace: str,
    gpus: int,
    gpu_resource: str,
    labels: Mapping[str, str],
    pod_spec: Mapping[str, Any],
) -> dict[str, Any]:
    """The run's K3k Cluster: virtual, its agents each limited to their share of the app's `gpus` (whole
    GPUs, in `gpu_resource`), placed as the compute resource's pod template places pods (its
    nodeSelector and priorityClassName)."""
    name = cluster_name(job)
    spec: dict[str, Any] = {
        "mode": "virtual",
        "servers": service.servers,
        "agents": service.agents,
        "persistence": {"type": service.persistence},
        "tlsSANs": [server_host(name, namespace)],
    }
    if service.version:
        spec["version"] = service.version
    if gpus:
        spec["workerLimit"] = {gpu_resource: str(gpus // service.agents)}
    if pod_spec.get("nodeSelector"):
        spec["nodeSelector"] = {str(key): str(value) for key, value in pod_spec["nodeSelector"].items()}
    if pod_spec.get("priorityClassName"):
        spec["priorityClass"] = str(pod_spec["priorityClassName"])
    return {
        "apiVersion": K3K_API,
        "kind": K3K_KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**labels, "klique.io/job": job},
        },
        "spec": spec,
    }


def validate_k3k(manifest: Mapping[str, Any]) -> None:
    """A K3k Cluster as Klique makes it (the CRD's schema is the cluster's): its kind, its spec's fields,
    their types. Raises ManifestInvalid with the path."""
    if manifest.get("apiVersion") != K3K_API or manifest.get("kind") != K3K_KIND:
        raise ManifestInvalid(f"not a {K3K_API} {K3K_KIND}", ("kind",))
    name = str((manifest.get("metadata") or {}).get("name") or "")
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?", name):
        raise ManifestInvalid("a DNS label of at most 40 characters", ("metadata", "name"))
    spec: Mapping[str, Any] = manifest.get("spec") or {}
    unknown = sorted(set(spec) - K3K_SPEC_FIELDS)
    if unknown:
        raise ManifestInvalid(f"unknown fields {', '.join(unknown)}", ("spec",))
    if spec.get("mode") != "virtual":
        raise ManifestInvalid(
            "virtual: a shared cluster's pods would ask the host for any GPUs", ("spec", "mode")
        )
    if spec.get("servers") not in SERVERS:
        raise ManifestInvalid("1, 3 or 5", ("spec", "servers"))
    agents = spec.get("agents")
    if not isinstance(agents, int) or isinstance(agents, bool) or not 1 <= agents <= MAX_AGENTS:
        raise ManifestInvalid(f"1 to {MAX_AGENTS}", ("spec", "agents"))
    for key in ("workerLimit", "nodeSelector"):
        found = spec.get(key, {})
        if not isinstance(found, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in found.items()
        ):
            raise ManifestInvalid("a map of text to text", ("spec", key))
    if (spec.get("persistence") or {}).get("type") not in PERSISTENCE:
        raise ManifestInvalid(f"one of {', '.join(PERSISTENCE)}", ("spec", "persistence", "type"))


# How the K3k controller reports on it --------------------------------------------------------------


def phase_of(cluster: Mapping[str, Any]) -> tuple[str, str]:
    """(phase, what its conditions say) of a Cluster as the controller last wrote its status."""
    status = cluster.get("status") or {}
    said = [
        f"{condition.get('reason') or condition.get('type')}: {condition.get('message')}".strip(": ")
        for condition in status.get("conditions") or []
        if isinstance(condition, dict) and condition.get("status") == "False" and condition.get("message")
    ]
    return str(status.get("phase") or "Unknown"), "; ".join(said)
