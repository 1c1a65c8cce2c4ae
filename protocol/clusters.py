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

Slurm (`service: "slurm"`): the app's pod is the cluster's controller and its login (`slurmctld`, and
the template's command, a terminal served through the route, where `sbatch` scripts run unchanged). Its
workers are Klique tasks of their own, made as Slurm asks for them: the nodes are CLOUD nodes of Slurm's
power saving, its ResumeProgram asks the plane (with the controller run's task token, so only that run's
token counts) for a worker task per node it wakes, and its SuspendProgram gives a node back once it has
been idle `idle_seconds`. Each worker task is a pod running `slurmd` for its node, configless from the
controller, with the GPUs its task was given: counted in policies, preemptible and metered like any task.
The app's own task holds the template's GPUs (usually none).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVICES = ("k3k", "slurm")
K3K_GROUP, K3K_VERSION, K3K_PLURAL = "k3k.io", "v1beta1", "clusters"
K3K_API = f"{K3K_GROUP}/{K3K_VERSION}"
K3K_KIND = "Cluster"
K3K_VERSION_PATTERN = re.compile(r"v[0-9]{1,2}\.[0-9]{1,3}\.[0-9]{1,3}-k3s[0-9]{1,3}")
PERSISTENCE = ("ephemeral", "dynamic")
SERVERS = (1, 3, 5)  # K3s' embedded etcd keeps a quorum with an odd number
MAX_AGENTS = 64
K3K_FIELDS = frozenset({"service", "servers", "agents", "version", "persistence"})
SLURM_FIELDS = frozenset(
    {
        "service",
        "workers",
        "worker_gpus",
        "worker_cpus",
        "worker_compute_resource",
        "partition",
        "idle_seconds",
    }
)
FIELDS = {"k3k": K3K_FIELDS, "slurm": SLURM_FIELDS}
K3K_SPEC_FIELDS = frozenset(
    {"mode", "servers", "agents", "version", "persistence", "tlsSANs", "workerLimit", "nodeSelector",
     "priorityClass"}
)  # fmt: skip
KUBECONFIG_PATH = "/var/run/klique/cluster"  # where the app's container finds the cluster's kubeconfig
KUBECONFIG_KEY = "kubeconfig.yaml"
ADMIN_NAME = "system:admin"  # the client certificate's subject: K3s' administrator,
ADMIN_GROUP = "system:masters"  # in the group Kubernetes gives every right
PHASES_FAILED = ("Failed",)
MAX_WORKERS = 64
MAX_WORKER_GPUS = 16
MAX_WORKER_CPUS = 512
MIN_IDLE_SECONDS, MAX_IDLE_SECONDS = 60, 7 * 24 * 3600
SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,39}")


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
    # Slurm: at most `workers` worker nodes, each a task of `worker_gpus` whole GPUs and `worker_cpus`
    # CPUs on `worker_compute_resource` ("" for the app's own), in one partition; a node idle for
    # `idle_seconds` is given back.
    workers: int = 1
    worker_gpus: int = 1
    worker_cpus: int = 4
    worker_compute_resource: str = ""
    partition: str = "gpu"
    idle_seconds: int = 300

    @classmethod
    def parse(cls, value: object, *, gpus: str | None = None) -> ClusterService:
        """The section, or ServiceInvalid listing every problem. `gpus` (the template's) must split evenly
        over the agents in whole GPUs."""
        if not isinstance(value, dict):
            raise ServiceInvalid(['cluster: an object {"service": "k3k", "agents": 1, ...}.'])
        service = value.get("service")
        if service not in SERVICES:
            unknown = sorted(set(value) - K3K_FIELDS - SLURM_FIELDS)
            said = [f"cluster.{key}: not a field of a cluster." for key in unknown]
            raise ServiceInvalid([f"cluster.service: one of {', '.join(SERVICES)}.", *said])
        fields = FIELDS[str(service)]
        problems = [f"cluster.{key}: not a field of a {service} cluster ({', '.join(sorted(fields))})."
                    for key in sorted(set(value) - fields)]  # fmt: skip
        if service == "slurm":
            return cls._slurm(value, problems)
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

    @classmethod
    def _slurm(cls, value: Mapping[str, Any], problems: list[str]) -> ClusterService:
        workers = _whole(value, "workers", 1, 1, MAX_WORKERS, "worker nodes", problems)
        gpus = _whole(value, "worker_gpus", 1, 0, MAX_WORKER_GPUS, "whole GPUs of each worker", problems)
        cpus = _whole(value, "worker_cpus", 4, 1, MAX_WORKER_CPUS, "CPUs of each worker", problems)
        idle = _whole(value, "idle_seconds", 300, MIN_IDLE_SECONDS, MAX_IDLE_SECONDS,
                      "seconds a worker stays idle before it is given back", problems)  # fmt: skip
        resource = value.get("worker_compute_resource", "")
        if not isinstance(resource, str) or len(resource) > 200:
            problems.append(
                "cluster.worker_compute_resource: a compute resource's name, or \"\" for the app's."
            )
            resource = ""
        partition = value.get("partition", "gpu")
        if not isinstance(partition, str) or not SLURM_NAME.fullmatch(partition):
            problems.append("cluster.partition: a Slurm partition's name (letters, digits, _ and -).")
            partition = "gpu"
        if problems:
            raise ServiceInvalid(problems)
        return cls("slurm", workers=workers, worker_gpus=gpus, worker_cpus=cpus,
                   worker_compute_resource=resource, partition=partition, idle_seconds=idle)  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        if self.service == "slurm":
            return {
                "service": "slurm",
                "workers": self.workers,
                "worker_gpus": self.worker_gpus,
                "worker_cpus": self.worker_cpus,
                "worker_compute_resource": self.worker_compute_resource,
                "partition": self.partition,
                "idle_seconds": self.idle_seconds,
            }
        return {
            "service": self.service,
            "servers": self.servers,
            "agents": self.agents,
            "version": self.version,
            "persistence": self.persistence,
        }


def _whole(  # noqa: PLR0917 -- one field's check, each argument its own
    value: Mapping[str, Any], key: str, default: int, low: int, high: int, what: str, problems: list[str]
) -> int:
    found = value.get(key, default)
    if isinstance(found, bool) or not isinstance(found, int) or not low <= found <= high:
        problems.append(f"cluster.{key}: a whole number of {what}, from {low} to {high}.")
        return default
    return found


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


# Slurm -----------------------------------------------------------------------------------------------

SLURM_PATH = "/var/run/klique/slurm"  # the cluster's files in its pods: config, munge key, programs
SLURMCTLD_PORT = 6817
RESUME_SECONDS = 3600  # how long Slurm waits for a worker task to start (it may queue behind others)
SUSPEND_SECONDS = 120
MUNGE_KEY_BYTES = 1024
WORKER_SECTION = "slurm_worker"  # a worker task's spec: which controller run, which node
HOSTLIST = re.compile(r"([A-Za-z0-9_.-]+)(?:\[([0-9,-]+)\])?")


def slurm_secret(job: str) -> str:
    """The controller run's Secret of the cluster's files, which its workers mount too."""
    return f"{job}-slurm"


def slurm_controller(job: str) -> str:
    """The controller's host name: its pod's, and the Service its workers reach it by."""
    return f"{cluster_name(job)}-ctld"


def slurm_nodes(job: str, service: ClusterService) -> list[str]:
    """The cluster's worker nodes, in order."""
    return [f"{cluster_name(job)}-w{index}" for index in range(service.workers)]


def expand_hostlist(text: str, *, limit: int = MAX_WORKERS) -> list[str]:
    """Slurm's compressed host list (`vc-1-w[0-3,7],vc-1-w9`) as names, as `scontrol show hostnames` gives
    them; ValueError where it is not one, or names more than `limit` hosts."""
    names: list[str] = []
    for item in re.split(r",(?![^\[]*\])", text.strip()):
        found = HOSTLIST.fullmatch(item)
        if not item or found is None:
            raise ValueError(f"not a Slurm host list: {text[:200]!r}")
        prefix, ranges = found.groups()
        if ranges is None:
            names.append(prefix)
            continue
        for piece in ranges.split(","):
            low, _, high = piece.partition("-")
            if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
                raise ValueError(f"not a Slurm host list: {text[:200]!r}")
            if int(high or low) - int(low) >= limit:
                raise ValueError(f"more than {limit} hosts in {text[:200]!r}")
            names.extend(f"{prefix}{number:0{len(low)}d}" for number in range(int(low), int(high or low) + 1))
        if len(names) > limit:
            raise ValueError(f"more than {limit} hosts in {text[:200]!r}")
    return names


def _numbered(prefix: str, count: int) -> str:
    """`prefix0` to `prefix<count-1>` as Slurm compresses them."""
    return f"{prefix}[0-{count - 1}]" if count > 1 else f"{prefix}0"


def _node_range(job: str, service: ClusterService) -> str:
    """The cluster's nodes (slurm_nodes) as slurm.conf and gres.conf name them."""
    return _numbered(f"{cluster_name(job)}-w", service.workers)


def slurm_conf(service: ClusterService, *, job: str) -> str:
    """The cluster's slurm.conf: CLOUD nodes woken and given back by Klique's programs, served to the
    workers configless by the controller."""
    cluster, nodes = cluster_name(job), _node_range(job, service)
    gres = f" Gres=gpu:{service.worker_gpus}" if service.worker_gpus else ""
    return "\n".join([
        "# Made by Klique's Kubernetes agent for this run of the cluster; changed, it is made again.",
        f"ClusterName={cluster.replace('-', '_')}",
        f"SlurmctldHost={slurm_controller(job)}",
        f"SlurmctldPort={SLURMCTLD_PORT}",
        "SlurmctldParameters=enable_configless,cloud_reg_addrs,idle_on_node_suspend",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "StateSaveLocation=/var/spool/slurmctld",
        "SlurmdSpoolDir=/var/spool/slurmd",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "SlurmdParameters=config_overrides",  # a worker has the CPUs its task asked for, not its host's
        "ReturnToService=2",
        "TreeWidth=65533",
        f"SuspendProgram={SLURM_PATH}/suspend",
        f"ResumeProgram={SLURM_PATH}/resume",
        f"ResumeFailProgram={SLURM_PATH}/suspend",
        f"SuspendTime={service.idle_seconds}",
        f"SuspendTimeout={SUSPEND_SECONDS}",
        f"ResumeTimeout={RESUME_SECONDS}",
        "ResumeRate=0",
        "SuspendRate=0",
        "PrivateData=cloud",  # powered-down nodes are listed (sinfo, scontrol), not hidden
        f"NodeName={nodes} State=CLOUD CPUs={service.worker_cpus}{gres}",
        f"PartitionName={service.partition} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])  # fmt: skip


GPU_LINKS = "/dev/klique-gpu"  # a worker's GPUs as Slurm counts them: links to the pod's own devices


def gres_conf(service: ClusterService, *, job: str) -> str:
    """Each worker's GPUs: its pod was given exactly these, whatever their numbers on the host, and the
    worker's start links them as GPU_LINKS0, 1, ... (Slurm drops a GPU without a device file). Slurm sets
    a job's CUDA_VISIBLE_DEVICES to their indices, which are the pod's own as CUDA counts them."""
    files = _numbered(GPU_LINKS, service.worker_gpus)
    line = f"NodeName={_node_range(job, service)} Name=gpu File={files}\n" if service.worker_gpus else ""
    return "AutoDetect=off\n" + line


def _program(action: str, *, plane: str, task_id: str) -> str:
    """slurmctld's resume or suspend program: the host list it is given, to the plane, under the
    controller run's task token. Only Klique's values are written in; Slurm's argument is sent as data."""
    return "\n".join([
        "#!/bin/sh",
        f"# Slurm's {action} program, made by Klique: the nodes go to the plane, which makes or ends their",
        "# worker tasks. slurmctld keeps no output of its programs: where it is the container's first",
        "# process, the plane's answer goes to its output, which is the app's log.",
        "set -u",
        'if [ "$(cat /proc/1/comm 2>/dev/null)" = slurmctld ]; then exec >>/proc/1/fd/2 2>&1; fi',
        "nodes=$(printf %s \"$1\" | tr -cd 'A-Za-z0-9_.,[]-')",
        'answer=$(curl --silent --show-error --fail-with-body --max-time 60 --retry 5 --retry-all-errors \\',
        f'  -H "Authorization: Bearer $(cat {SLURM_PATH}/token)" -H "Content-Type: application/json" \\',
        f'  --data "{{\\"{action}\\": \\"$nodes\\"}}" "{plane}/agents/v1/tasks/{task_id}/slurm/" 2>&1)',
        "said=$?",
        f'echo "klique: {action} $nodes: $answer"',
        "exit $said",
        "",
    ])  # fmt: skip


RECONCILE_SECONDS = 30


def _reconciler(*, plane: str, task_id: str) -> str:
    """The controller's reconciler: a node whose worker task ended outside Slurm (preempted, failed, its
    pod gone) is powered down, so that Slurm requeues its jobs and wakes the node again when it wants it,
    rather than keeping it down for good. A node powered down, or on its way up or down, is left alone."""
    return "\n".join([
        "#!/bin/sh",
        "# Klique's reconciler, beside slurmctld: the nodes Slurm counts on whose worker task is gone are",
        "# powered down (their jobs requeued; woken again as new tasks when jobs want them).",
        "set -u",
        'if [ "$(cat /proc/1/comm 2>/dev/null)" = slurmctld ]; then exec >>/proc/1/fd/2 2>&1; fi',
        f"while sleep {RECONCILE_SECONDS}; do",
        "  live=$(curl --silent --show-error --fail --max-time 30 \\",
        f'    -H "Authorization: Bearer $(cat {SLURM_PATH}/token)" \\',
        f'    "{plane}/agents/v1/tasks/{task_id}/slurm/") || continue',
        "  sinfo --noheader --Node --format '%N %t %E' | sort -u | while read -r node state reason; do",
        '    if [ "$state" = "down~" ] && [ "$reason" = "ResumeTimeout reached" ]; then',
        '      echo "klique: $node was not up within Slurm\'s resume timeout (its worker task waited):" \\',
        '        "back in service"',
        '      scontrol update NodeName="$node" State=RESUME',
        "      continue",
        "    fi",
        "    case \"$state\" in *'~'|*'%'|*'#') continue ;; esac  # powered down, going down, coming up",
        '    case " $live " in *" $node "*) continue ;; esac',
        '    echo "klique: the worker task of $node ended outside Slurm: powered down, jobs requeued"',
        '    scontrol update NodeName="$node" State=POWER_DOWN_FORCE Reason="klique: its worker task ended"',
        "  done",
        "done",
        "",
    ])  # fmt: skip


START = f"""#!/bin/sh
# Klique's Slurm cluster, in each of its pods: munge with the cluster's key, then the role's daemon.
#   start controller -- LOGIN...   slurmctld, with the login (the app's command) beside it
#   start worker NODE CONTROLLER   slurmd for NODE, its configuration from the controller
set -eu
here={SLURM_PATH}
export SLURM_CONF="$here/slurm.conf"
mkdir -p /etc/munge /run/munge /var/log/munge
cp "$here/munge.key" /etc/munge/munge.key
chown -R munge:munge /etc/munge /run/munge /var/log/munge
chmod 0400 /etc/munge/munge.key
runuser -u munge -- munged
role=$1
shift
case "$role" in
controller)
    [ "${{1:-}}" = "--" ] && shift
    mkdir -p /var/spool/slurmctld
    "$@" &
    sh "$here/reconcile" &
    exec slurmctld -D -f "$SLURM_CONF"
    ;;
worker)
    unset SLURM_CONF
    mkdir -p /var/spool/slurmd
    index=0
    for device in /dev/nvidia[0-9]*; do  # the pod's GPUs, as the cluster's gres.conf names them
        [ -e "$device" ] || continue
        ln -sf "$device" "{GPU_LINKS}$index"
        index=$((index + 1))
    done
    # -b: the node says it booted now (a pod shares its host's boot time, and Slurm waits for a
    # resumed node to have booted since it was asked for)
    exec slurmd -D -b -N "$1" --conf-server "$2:{SLURMCTLD_PORT}"
    ;;
esac
echo "start: controller or worker, not $role" >&2
exit 2
"""


def slurm_files(service: ClusterService, *, job: str, plane: str, task_id: str, token: str) -> dict[str, str]:
    """The controller run's Secret but its munge key: slurm.conf, gres.conf, the run's task token and the
    programs. `plane` is the plane's address as the agent reaches it (http or https)."""
    if not re.fullmatch(r"https?://[A-Za-z0-9.:\[\]_-]+(/[A-Za-z0-9._~/-]*)?", plane):
        raise ValueError(f"the plane's address {plane!r} cannot be written into a program")
    if not re.fullmatch(r"[0-9a-f-]{36}", task_id):
        raise ValueError(f"not a task id: {task_id!r}")
    return {
        "slurm.conf": slurm_conf(service, job=job),
        "gres.conf": gres_conf(service, job=job),
        "token": token,
        "resume": _program("resume", plane=plane.rstrip("/"), task_id=task_id),
        "suspend": _program("suspend", plane=plane.rstrip("/"), task_id=task_id),
        "reconcile": _reconciler(plane=plane.rstrip("/"), task_id=task_id),
        "start": START,
    }


@dataclass(frozen=True, slots=True)
class SlurmWorker:
    """A worker task's `slurm_worker` section: its controller's run, its node, the controller run's
    Secret it mounts, the CPUs Slurm counts on it."""

    controller: str
    lease: str
    node: str
    secret: str
    cpus: int

    @classmethod
    def parse(cls, value: object) -> SlurmWorker:
        if not isinstance(value, dict):
            raise ValueError("slurm_worker: an object {controller, lease, node, secret, cpus}")  # noqa: TRY004
        node, secret, cpus = value.get("node"), value.get("secret"), value.get("cpus")
        controller = value.get("controller")
        if not isinstance(controller, str) or not re.fullmatch(r"[0-9a-f][0-9a-f-]{0,35}", controller):
            raise ValueError("slurm_worker.controller: the controller's task id")
        if not isinstance(node, str) or not re.fullmatch(
            r"vc-[a-z0-9]{1,12}-[a-z0-9]{1,8}-w[0-9]{1,2}", node
        ):
            raise ValueError("slurm_worker.node: a node of a Slurm cluster Klique made")
        if not isinstance(secret, str) or not re.fullmatch(r"k-[a-z0-9-]{1,50}-slurm", secret):
            raise ValueError("slurm_worker.secret: the Secret of the controller's run")
        if isinstance(cpus, bool) or not isinstance(cpus, int) or not 1 <= cpus <= MAX_WORKER_CPUS:
            raise ValueError(f"slurm_worker.cpus: 1 to {MAX_WORKER_CPUS}")
        return cls(controller, str(value.get("lease", "")), node, secret, cpus)


def worker_command(node: str, controller: str) -> list[str]:
    """A worker task's command: slurmd for its node."""
    return ["sh", f"{SLURM_PATH}/start", "worker", node, controller]
