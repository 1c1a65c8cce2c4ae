"""Clustering services on a Kubernetes pool (protocol.clusters, agents.k3k, agents.kubernetes) against
kmock's API emulator, with the tests standing in for the K3k controller: it writes a Cluster's status and
its bootstrap Secret (certificate authorities made here, as K3s makes its own), as the real controller
does. The app's Job is made with its cluster, its GPUs given to the cluster's workers; the kubeconfig is
minted only once the cluster is ready, signed by the cluster's client CA, once per run; a failed or deleted
cluster ends the app saying why; a stopped app takes its cluster with it."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from agents import k3k
from agents.backend import free_port
from agents.kubernetes import Kubernetes
from agents.state import State
from protocol import clusters, pods
from tests.agents.kube import NAMESPACE, Cluster, Kubelet
from tests.agents.test_kubernetes import Recorder, assignment, backend, begin, refusal, until

pytestmark = pytest.mark.timeout(120)

IMAGE = "ghcr.io/klique/klique:1.0"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster(k3k=True).start()
    yield running
    running.stop()


def cluster_task(task_id: str, *, gpus: float = 4, agents: int = 2, **extra: Any) -> dict[str, Any]:
    port = free_port()
    task = assignment(task_id, gpus=gpus, **extra)
    task["spec"] = {
        "command": ["kubectl", "proxy", "--address=127.0.0.1", f"--port={port}", "--disable-filter=true"],
        "environment": {"PORT": str(port)},
        "app": {
            "instance": "0a1b2c",
            "port": port,
            "health_path": "/version",
            "startup_seconds": 1800,
            "cluster": {"service": "k3k", "agents": agents},
        },
    }
    return task


def authority(name: str, *, kind: str = "ec") -> tuple[x509.Certificate, Any]:
    key: Any = (
        ec.generate_private_key(ec.SECP256R1()) if kind == "ec" else rsa.generate_private_key(65537, 2048)
    )
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return certificate, key


def pem(item: Any) -> str:
    if isinstance(item, x509.Certificate):
        return item.public_bytes(serialization.Encoding.PEM).decode()
    encoded: bytes = item.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return encoded.decode()


def bootstrap(*, kind: str = "ec") -> tuple[dict[str, Any], x509.Certificate, x509.Certificate]:
    """What the K3k controller keeps of a cluster's authorities, and the server and client CAs."""
    server, server_key = authority("k3s-server-ca", kind=kind)
    client, client_key = authority("k3s-client-ca", kind=kind)
    document = {
        "serverCA": {"Timestamp": "", "Content": pem(server)},
        "serverCAKey": {"Timestamp": "", "Content": pem(server_key)},
        "clientCA": {"Timestamp": "", "Content": pem(client)},
        "clientCAKey": {"Timestamp": "", "Content": pem(client_key)},
    }
    return document, server, client


def check_kubeconfig(text: str, name: str, server: x509.Certificate, client: x509.Certificate) -> bytes:
    """The kubeconfig reaches the cluster's API at its Service, trusts its server CA alone, and carries an
    administrator's certificate the cluster's client CA signed, with its key. Returns the certificate."""
    config = yaml.safe_load(text)
    (entry,) = config["clusters"]
    assert entry["cluster"]["server"] == f"https://k3k-{name}-service.{NAMESPACE}.svc"
    assert base64.b64decode(entry["cluster"]["certificate-authority-data"]).decode() == pem(server)
    (user,) = config["users"]
    chain = base64.b64decode(user["user"]["client-certificate-data"])
    certificate = x509.load_pem_x509_certificate(chain)
    certificate.verify_directly_issued_by(client)
    assert certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:admin"
    assert certificate.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
    key = serialization.load_pem_private_key(base64.b64decode(user["user"]["client-key-data"]), None)
    assert key.public_key().public_numbers() == certificate.public_key().public_numbers()  # type: ignore[union-attr]
    assert config["current-context"] == name
    return certificate.public_bytes(serialization.Encoding.PEM)


async def launched(kube: Kubernetes, task: dict[str, Any], recorder: Recorder) -> tuple[str, str]:
    """The app started on the agent: its Job's name and its cluster's."""
    begin(kube, task)
    await kube.start(task, recorder)
    job_name = pods.job_name(task["task_id"], task["lease_id"])
    return job_name, clusters.cluster_name(job_name)


def test_a_k3k_cluster_is_made_with_the_apps_gpus_and_its_kubeconfig_once_it_is_ready(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = cluster_task("vc1", gpus=4, agents=2)

    async def scenario() -> None:
        job_name, name = await launched(kube, task, recorder)
        made = await asyncio.to_thread(kubelet.k3k_cluster, name)
        pods.validate_workload(made)
        assert made["spec"]["mode"] == "virtual"
        assert made["spec"]["agents"] == 2
        assert made["spec"]["workerLimit"] == {"nvidia.com/gpu": "2"}  # 4 GPUs over 2 workers
        assert made["metadata"]["labels"]["klique.io/task"] == "vc1"
        assert made["metadata"]["ownerReferences"][0]["name"] == job_name
        job = await asyncio.to_thread(kubelet.job, job_name)
        pods.validate_workload(job)
        spec = job["spec"]["template"]["spec"]
        (main,) = spec["containers"]
        assert "nvidia.com/gpu" not in str(main["resources"])  # the app's own pod holds none of them
        assert {"name": "KUBECONFIG", "value": "/var/run/klique/cluster/kubeconfig.yaml"} in main["env"]
        volume = next(item for item in spec["volumes"] if item.get("secret"))
        assert volume["secret"]["secretName"] == f"{job_name}-kubeconfig"

        # Until the controller says it is ready, the app waits for it and says so: no kubeconfig yet.
        await until(
            lambda: any(
                "waiting for the K3k Cluster" in body.get("reason", "") for body in recorder.of("status")
            )
        )
        await asyncio.to_thread(kubelet.k3k_phase, name, "Provisioning")
        await until(lambda: any("(Provisioning)" in body.get("reason", "") for body in recorder.of("status")))
        assert await asyncio.to_thread(kubelet.gone, "Secret", f"{job_name}-kubeconfig")

        # Ready: the kubeconfig is minted from the bootstrap Secret, into the run's own Secret.
        document, server, client = bootstrap()
        await asyncio.to_thread(kubelet.k3k_bootstrap, name, document)
        await asyncio.to_thread(kubelet.k3k_phase, name, "Ready")
        await until(lambda: not kubelet.gone("Secret", f"{job_name}-kubeconfig"))
        secret = await asyncio.to_thread(kubelet.secret, f"{job_name}-kubeconfig")
        minted = check_kubeconfig(secret["stringData"]["kubeconfig.yaml"], name, server, client)
        assert secret["metadata"]["ownerReferences"][0]["name"] == job_name
        assert "clientCAKey" not in json.dumps(secret)  # the CA's key stays in the controller's Secret

        # A restarted agent keeps the kubeconfig it finds: no second certificate.
        await kube.stop_all(0)
        again = Kubernetes(kube.settings, State(tmp_path / "agent.sqlite"), kube.api)
        again_recorder = Recorder(again.state)
        again.adopt(again_recorder)
        await until(lambda: job_name in again.minted)
        kept = (await asyncio.to_thread(kubelet.secret, f"{job_name}-kubeconfig"))["stringData"]
        assert check_kubeconfig(kept["kubeconfig.yaml"], name, server, client) == minted

        # The app is stopped: the cluster and the kubeconfig go with it.
        await again.stop("vc1", 5)
        (result,) = await until(lambda: again_recorder.of("result"))
        assert result["stopped"] is True
        await until(
            lambda: kubelet.gone("Cluster", name) and kubelet.gone("Secret", f"{job_name}-kubeconfig")
        )
        await again.stop_all(0)

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["failed", "deleted"])
def test_a_cluster_that_fails_or_is_deleted_ends_its_app_saying_why(
    cluster: Cluster, tmp_path: Path, how: str
) -> None:
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = cluster_task("vc2", gpus=1, agents=1)

    async def scenario() -> None:
        job_name, name = await launched(kube, task, recorder)
        await until(lambda: recorder.of("status"))
        if how == "failed":
            await asyncio.to_thread(
                kubelet.k3k_phase, name, "Failed", "the server pod cannot pull rancher/k3s"
            )
            words = f"the K3k Cluster {name} failed: ServerFailed: the server pod cannot pull rancher/k3s"
        else:
            await asyncio.sleep(5.5)  # past the listing's lag after creation
            await asyncio.to_thread(kubelet.delete_k3k, name)
            words = f"the K3k Cluster {name} was deleted outside Klique"
        (result,) = await until(lambda: recorder.of("result"))
        assert result["exit_code"] is None
        assert any(words in line for line in recorder.lines())
        await until(lambda: kubelet.gone("Job", job_name) and kubelet.gone("Cluster", name))
        assert kube.running() == []
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_bootstrap_secret_not_there_yet_keeps_the_app_waiting_then_it_goes_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE), Kubelet(cluster)
    recorder = Recorder(kube.state)
    task = cluster_task("vc3", gpus=2, agents=2)

    async def scenario() -> None:
        job_name, name = await launched(kube, task, recorder)
        await asyncio.to_thread(kubelet.k3k_phase, name, "Ready")
        await until(
            lambda: any("bootstrap Secret" in body.get("reason", "") for body in recorder.of("status"))
        )
        assert await asyncio.to_thread(kubelet.gone, "Secret", f"{job_name}-kubeconfig")
        document, server, client = bootstrap(kind="rsa")  # K3s' older clusters sign with RSA
        await asyncio.to_thread(kubelet.k3k_bootstrap, name, document)
        await until(lambda: not kubelet.gone("Secret", f"{job_name}-kubeconfig"))
        secret = await asyncio.to_thread(kubelet.secret, f"{job_name}-kubeconfig")
        check_kubeconfig(secret["stringData"]["kubeconfig.yaml"], name, server, client)
        await kube.stop_all(0)

    asyncio.run(scenario())


def test_a_pool_without_k3k_keeps_the_app_queued_saying_what_to_install_and_makes_nothing(
    tmp_path: Path,
) -> None:
    plain = Cluster().start()
    try:
        kube, kubelet = backend(plain, tmp_path, relay_image=IMAGE), Kubelet(plain)
        task = cluster_task("vc4")

        refused = refusal(kube, task)
        assert refused.permanent is False  # it waits in the queue while an administrator installs K3k
        assert "The app's cluster was not made: " in str(refused)
        assert "does not serve k3k.io/v1beta1 clusters: install K3k" in str(refused)
        job_name = pods.job_name("vc4", "lease-vc4")
        assert kubelet.jobs() == []
        assert kubelet.gone("Secret", job_name)
        assert kubelet.gone("Secret", f"{job_name}-app")
    finally:
        plain.stop()


@pytest.mark.parametrize(
    ("gpus", "agents", "extra", "words"),
    [
        (3, 2, {}, "3 GPUs do not split evenly over the cluster's 2 agents"),
        (0.5, 1, {}, "a fraction or a MIG slice cannot be split"),
        (1, 1, {"sharing": "mig", "mig_profile": "1g.10gb"}, "a fraction or a MIG slice cannot be split"),
    ],
)
def test_gpus_a_cluster_cannot_split_over_its_workers_are_refused_for_good(
    cluster: Cluster, tmp_path: Path, gpus: float, agents: int, extra: dict[str, Any], words: str
) -> None:
    kube = backend(cluster, tmp_path, relay_image=IMAGE)
    task = cluster_task("vc5", gpus=gpus, agents=agents, **extra)

    refused = refusal(kube, task)
    assert refused.permanent
    assert words in str(refused)
    assert Kubelet(cluster).jobs() == []


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ("not json", "is not JSON"),
        ("[1, 2]", "is not a JSON object"),
        ("{}", "has no serverCA in PEM"),
        ('{"serverCA": {"Content": "x"}}', "has no serverCA in PEM"),
        ('{"serverCA": "-----BEGIN CERTIFICATE-----"}', "has no serverCA in PEM"),
        (
            json.dumps(
                {
                    key: {"Content": "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n"}
                    for key in ("serverCA", "clientCA", "clientCAKey")
                }
            ),
            "cannot be read",
        ),
    ],
)
def test_a_bootstrap_secret_that_is_not_what_k3k_writes_mints_nothing(document: str, words: str) -> None:
    with pytest.raises(k3k.BootstrapUnreadable, match=words):
        k3k.admin_kubeconfig(document, server="https://x", name="vc")


def test_a_cluster_of_no_run_is_deleted_after_its_grace_and_a_runs_own_is_kept(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent killed after it made a run's cluster and before the run's Job leaves a cluster no Job owns
    and no run counts, holding GPUs: the next agent deletes it, after a grace for a start under way."""
    from agents import kubernetes

    monkeypatch.setattr(kubernetes, "CLUSTER_SWEEP_SECONDS", 0.2)
    monkeypatch.setattr(kubernetes, "CLUSTER_ORPHAN_SECONDS", 1.5)
    kube, kubelet = backend(cluster, tmp_path, relay_image=IMAGE), Kubelet(cluster)
    recorder = Recorder(kube.state)

    def left_behind(job: str) -> str:
        made = clusters.k3k_cluster(
            clusters.ClusterService(), job=job, namespace=NAMESPACE, gpus=2, gpu_resource="nvidia.com/gpu",
            labels={"klique.io/agent": kube.settings.cluster.agent, "klique.io/task": job}, pod_spec={},
        )  # fmt: skip
        kubelet.custom.create_namespaced_custom_object(
            "k3k.io", "v1beta1", NAMESPACE, "clusters", made, _preload_content=False
        )
        return str(made["metadata"]["name"])

    async def scenario() -> None:
        first = await asyncio.to_thread(left_behind, "k-dead1-0a0a0a0a")
        kube.adopt(recorder)  # with no run at all, the agent still looks for them
        await until(lambda: kubelet.gone("Cluster", first), timeout=20)

        _, name = await launched(kube, cluster_task("vc6", gpus=1, agents=1), recorder)
        second = await asyncio.to_thread(left_behind, "k-dead2-0b0b0b0b")
        started = asyncio.get_running_loop().time()
        await until(lambda: kubelet.gone("Cluster", second), timeout=20)
        assert asyncio.get_running_loop().time() - started >= 1.0  # not before its grace
        assert not await asyncio.to_thread(kubelet.gone, "Cluster", name)  # the run's own stays
        assert kube.running() == ["vc6"]
        await kube.stop_all(0)

    asyncio.run(scenario())
