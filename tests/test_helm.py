"""The Helm charts in deploy/helm, with the real `helm` (v4) and `kubectl` (tools/kube_tools.py fetches
them): linted, rendered with default and non-default values, every manifest validated against the
Kubernetes OpenAPI schema, and what each must hold checked: the agent's RBAC scoped to its namespace, its
configuration read by the agent itself, beat exactly one, migrations a hook, nothing running as root."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from agents.kubernetes import KubeSettings
from protocol import pods
from tools.kube_tools import fetch

ROOT = Path(__file__).resolve().parent.parent
CHARTS = ROOT / "deploy" / "helm"
BIN = ROOT / ".tools" / "bin"
AGENT = ["--set", "plane.url=https://acme.klique.example", "--set", "token.value=kqa_0123456789abcdef"]
TEMPLATE = "spec:\n  priorityClassName: research\n  containers:\n    - name: main\n      image: ${image}\n"


@pytest.fixture(scope="module")
def helm() -> Path:
    fetch(BIN)
    return BIN / "helm"


def run(helm: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *arguments], capture_output=True, text=True, check=False, timeout=120)


def rendered(helm: Path, chart: str, *values: str, namespace: str = "ml") -> list[dict[str, Any]]:
    done = run(helm, "template", "release", str(CHARTS / chart), "--namespace", namespace, *values)
    assert done.returncode == 0, done.stderr
    return [document for document in yaml.safe_load_all(done.stdout) if document]


def of_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [document for document in documents if document["kind"] == kind]


AGENT_VALUES = [
    [],
    [
        "--set",
        "kubernetes.localQueue=team-a",
        "--set",
        "workVolume.claimName=klique-work",
        "--set",
        "kubernetes.sharedFilesystem.path=/shared",
        "--set",
        "kubernetes.sharedFilesystem.claimName=shared",
        "--set",
        "capacity.clusterWide=false",
        "--set",
        "volumes.datasets.path=/datasets,volumes.datasets.claimName=imagenet",
        "--set",
        "volumes.checkpoints.path=/checkpoints,volumes.checkpoints.claimName=ckpt",
        "--set",
        "volumes.checkpoints.readOnly=false",
        "--set",
        "state.existingClaim=agent-state",
        "--set-string",
        f"templates.Research\\: 8 GPUs={TEMPLATE}",
    ],
]
PLANE_VALUES = [
    [],
    [
        "--set",
        "ingress.enabled=false",
        "--set",
        "web.autoscaling.enabled=false",
        "--set",
        "web.replicas=3",
        "--set",
        "migrations.enabled=false",
        "--set",
        "files.existingClaim=klique-files",
        "--set",
        "baseDomain=gpu.corp.example",
    ],
]


@pytest.mark.parametrize("values", AGENT_VALUES, ids=["defaults", "kueue-volumes-templates"])
def test_the_agent_chart_lints_renders_and_validates(helm: Path, values: list[str]) -> None:
    lint = run(helm, "lint", str(CHARTS / "klique-agent"), *AGENT, *values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    documents = rendered(helm, "klique-agent", *AGENT, *values)
    for document in documents:
        pods.validate(document)
    (role,) = of_kind(documents, "Role")
    resources = {resource for rule in role["rules"] for resource in rule["resources"]}
    assert resources == {
        "jobs",
        "jobsets",
        "pytorchjobs",
        "clusters",
        "pods",
        "pods/log",
        "secrets",
        "services",
        "networkpolicies",
        "events",
        "workloads",
        "leases",
    }
    assert all(document["metadata"].get("namespace") == "ml" for document in of_kind(documents, "Role"))
    secrets = {verb for rule in role["rules"] if "secrets" in rule["resources"] for verb in rule["verbs"]}
    assert secrets == {"create", "get", "patch", "delete"}  # what the agent calls, and no more
    k3k = {verb for rule in role["rules"] if rule["apiGroups"] == ["k3k.io"] for verb in rule["verbs"]}
    assert k3k == {"create", "get", "list", "patch", "delete"}  # K3k Clusters, of clustering services
    cluster_roles = of_kind(documents, "ClusterRole")
    if "capacity.clusterWide=false" in values:
        assert not cluster_roles
    else:
        (reader,) = cluster_roles
        assert {verb for rule in reader["rules"] for verb in rule["verbs"]} <= {"get", "list"}
    (deployment,) = of_kind(documents, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    (token,) = [item for item in container["env"] if item["name"] == "KLIQUE_AGENT_TOKEN"]
    assert "secretKeyRef" in token["valueFrom"]
    assert "kqa_" not in str(deployment)  # the token is in its Secret only
    (config,) = of_kind(documents, "ConfigMap")
    settings = KubeSettings.read(tomllib.loads(config["data"]["agent.toml"]), "release")  # the agent reads it
    assert settings.cluster.namespace == "ml"
    assert (settings.leader_election, settings.lease_seconds) == (True, 15)
    assert settings.relay_image == container["image"]  # apps' relays run from the agent's own image
    pod_name = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    assert pod_name in container["env"]  # the Lease names the pod that holds it
    if values:
        assert settings.cluster.local_queue == "team-a"
        assert set(settings.templates) == {"default", "Research: 8 GPUs"}
        assert settings.cluster.work_volume == {"persistentVolumeClaim": {"claimName": "klique-work"}}
        offered = {name: (v.path, v.read_only, v.source) for name, v in settings.cluster.volumes.items()}
        assert offered == {
            "datasets": ("/datasets", True, {"persistentVolumeClaim": {"claimName": "imagenet"}}),
            "checkpoints": ("/checkpoints", False, {"persistentVolumeClaim": {"claimName": "ckpt"}}),
        }
    else:
        assert settings.cluster.volumes == {}


@pytest.mark.parametrize(
    ("values", "words"),
    [
        (["--set", "token.value=kqa_x"], "plane.url is required"),
        (["--set", "plane.url=https://a.example"], "the agent token is required"),
        ([*AGENT, "--set", "replicas=2"], "ReadWriteMany"),
        ([*AGENT, "--set", "replicas=4,state.accessMode=ReadWriteMany"], "maximum"),
        ([*AGENT, "--set", "state.accessMode=ReadOnlyMany"], "accessMode"),
        ([*AGENT, "--set", "kubernetes.sharedFilesystem.path=relative"], "sharedFilesystem"),
        ([*AGENT, "--set", "unknown=1"], "additional properties"),
        ([*AGENT, "--set", "volumes.data.path=data,volumes.data.claimName=c"], "volumes"),
        ([*AGENT, "--set", "volumes.data.path=/data"], "claimName"),
        ([*AGENT, "--set", "volumes.Data.path=/data,volumes.Data.claimName=c"], "invalid propertyName"),
    ],
    ids=[
        "no-url",
        "no-token",
        "two-replicas-on-one-node-storage",
        "four-replicas",
        "read-only-state",
        "relative-path",
        "unknown-value",
        "volume-path",
        "volume-claim",
        "volume-name",
    ],
)
def test_the_agent_chart_refuses_values_it_cannot_use(helm: Path, values: list[str], words: str) -> None:
    done = run(helm, "template", "release", str(CHARTS / "klique-agent"), *values)
    assert done.returncode != 0
    assert words in done.stderr


def test_standbys_share_the_state_on_a_claim_every_node_mounts(helm: Path) -> None:
    values = [*AGENT, "--set", "replicas=2,state.accessMode=ReadWriteMany"]
    assert run(helm, "lint", str(CHARTS / "klique-agent"), *values).returncode == 0
    documents = rendered(helm, "klique-agent", *values)
    for document in documents:
        pods.validate(document)
    (deployment,) = of_kind(documents, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--shared-state" in container["args"]  # opened once the Lease is held, with a rollback journal
    spread = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert (
        spread["podAffinityTerm"]["labelSelector"]["matchLabels"]
        == deployment["spec"]["selector"]["matchLabels"]
    )
    (claim,) = of_kind(documents, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (config,) = of_kind(documents, "ConfigMap")
    assert KubeSettings.read(tomllib.loads(config["data"]["agent.toml"]), "release").leader_election is True
    # One replica on node-local storage: no flag, no spreading, a ReadWriteOnce claim.
    (single,) = of_kind(rendered(helm, "klique-agent", *AGENT), "Deployment")
    assert "--shared-state" not in single["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "affinity" not in single["spec"]["template"]["spec"]


def test_a_pod_template_the_agent_would_refuse_is_caught_by_the_agent_check(helm: Path) -> None:
    broken = "spec:\n  containers:\n    - name: main\n      image: ${imagee}\n"
    documents = rendered(helm, "klique-agent", *AGENT, "--set-string", f"templates.bad={broken}")
    (config,) = of_kind(documents, "ConfigMap")
    with pytest.raises(pods.PodTemplateInvalid, match=r"'bad', line 4: unknown variable"):
        KubeSettings.read(tomllib.loads(config["data"]["agent.toml"]), "release")


@pytest.mark.parametrize("values", PLANE_VALUES, ids=["defaults", "no-ingress-fixed-replicas"])
def test_the_control_plane_chart_lints_renders_and_validates(helm: Path, values: list[str]) -> None:
    lint = run(helm, "lint", str(CHARTS / "klique"), *values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    documents = rendered(helm, "klique", *values, namespace="klique")
    for document in documents:
        pods.validate(document)
    deployments = {document["metadata"]["name"]: document for document in of_kind(documents, "Deployment")}
    assert set(deployments) == {"release-web", "release-worker", "release-beat"}
    beat = deployments["release-beat"]["spec"]
    assert beat["replicas"] == 1
    assert beat["strategy"]["type"] == "Recreate"
    web = deployments["release-web"]["spec"]["template"]["spec"]["containers"][0]
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            names = {item["name"]: item for item in container["env"]}
            for secret in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "KLIQUE_MASTER_KEYS"):
                assert "secretKeyRef" in names[secret]["valueFrom"]
    jobs = of_kind(documents, "Job")
    hpas, ingresses = of_kind(documents, "HorizontalPodAutoscaler"), of_kind(documents, "Ingress")
    if values:
        assert not jobs
        assert not hpas
        assert not ingresses
        assert deployments["release-web"]["spec"]["replicas"] == 3
    else:
        (migrate,) = jobs
        assert migrate["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert migrate["spec"]["template"]["spec"]["containers"][0]["command"] == ["klique", "migrate"]
        (ingress,) = ingresses
        assert [rule["host"] for rule in ingress["spec"]["rules"]] == ["klique.example", "*.klique.example"]
        assert "replicas" not in deployments["release-web"]["spec"]
        assert len(hpas) == 1
    assert len(of_kind(documents, "PodDisruptionBudget")) == 1


def test_the_control_plane_chart_notes_say_how_to_reach_the_portal(helm: Path) -> None:
    done = run(
        helm, "install", "release", str(CHARTS / "klique"), "--dry-run=client", "--namespace", "klique"
    )
    assert done.returncode == 0, done.stderr
    assert "https://klique.example/" in done.stdout
    assert "provider_admin" in done.stdout


def test_kubectl_reads_the_rendered_charts(helm: Path, tmp_path: Path) -> None:
    """The real kubectl parses every rendered object: `kubectl kustomize` over the charts' output reads
    and writes each one back (offline: no API server is needed, or reachable here)."""
    kubectl = BIN / "kubectl"
    for chart, values in (("klique", []), ("klique-agent", AGENT)):
        done = run(helm, "template", "release", str(CHARTS / chart), *values)
        assert done.returncode == 0, done.stderr
        folder = tmp_path / chart
        folder.mkdir()
        (folder / "rendered.yaml").write_text(done.stdout)
        (folder / "kustomization.yaml").write_text("resources:\n  - rendered.yaml\n")
        read = subprocess.run(
            [str(kubectl), "kustomize", str(folder)], capture_output=True, text=True, check=False, timeout=60
        )
        assert read.returncode == 0, read.stderr
        ours = [document for document in yaml.safe_load_all(done.stdout) if document]
        back = [document for document in yaml.safe_load_all(read.stdout) if document]
        assert sorted((d["kind"], d["metadata"]["name"]) for d in back) == sorted(
            (d["kind"], d["metadata"]["name"]) for d in ours
        )
