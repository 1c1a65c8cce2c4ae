"""Where the Kubernetes backend finds its credentials, each way against the emulator through the official
client: the `kubeconfig` setting with a chosen context, $KUBECONFIG when the agent is not in a pod, the
pod's service account over TLS with the cluster's CA (its token read again as the kubelet rotates it),
and a sentence saying what to set when there are none."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes.config import incluster_config

from agents.kubernetes import Api, KubeSettings, credentials
from tests.agents.kube import NAMESPACE, Cluster


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster().start()
    yield running
    running.stop()


def read(**table: Any) -> KubeSettings:
    return KubeSettings.read({"agent": {"kubernetes": {"namespace": NAMESPACE, **table}}}, "agent-1")


def kubeconfig(path: Path, contexts: dict[str, tuple[str, str]], current: str) -> Path:
    """A kubeconfig with one cluster and one user (a bearer token) per context."""
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": current,
        "clusters": [{"name": name, "cluster": {"server": url}} for name, (url, _) in contexts.items()],
        "users": [{"name": name, "user": {"token": token}} for name, (_, token) in contexts.items()],
        "contexts": [
            {"name": name, "context": {"cluster": name, "user": name, "namespace": NAMESPACE}}
            for name in contexts
        ],
    }
    path.write_text(yaml.safe_dump(document))
    return path


def lists(api: Api) -> bool:
    items, version = api.listing("Job")
    return items == [] and bool(version)


def test_the_kubeconfig_setting_with_a_chosen_context(cluster: Cluster, tmp_path: Path) -> None:
    path = kubeconfig(
        tmp_path / "config",
        {"elsewhere": ("http://127.0.0.1:9", "t-elsewhere"), "ml": (cluster.url, "t-ml")},
        current="elsewhere",
    )
    api = Api(read(kubeconfig=str(path), context="ml"))
    assert api.where == cluster.url
    assert lists(api)
    assert cluster.emulator is not None
    assert cluster.emulator.authorization == "Bearer t-ml"
    assert Api(read(kubeconfig=str(path))).where == "http://127.0.0.1:9"  # its current context


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda folder: folder / "absent", "absent"),
        (lambda folder: (folder / "empty").write_text("") and folder / "empty", "cannot be used"),
        (lambda folder: (folder / "junk").write_text("clusters: [") and folder / "junk", "cannot be used"),
    ],
)
def test_a_kubeconfig_that_cannot_be_used_is_named(tmp_path: Path, make: Any, says: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ValueError, match=f"the kubeconfig {path} cannot be used") as refused:
        credentials(read(kubeconfig=str(path)))
    assert says in str(refused.value)


def test_an_unknown_context_is_named(cluster: Cluster, tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "config", {"ml": (cluster.url, "t")}, current="ml")
    with pytest.raises(ValueError, match="with context 'prod'"):
        credentials(read(kubeconfig=str(path), context="prod"))


def test_outside_a_pod_the_kubeconfig_variable_is_used(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = kubeconfig(tmp_path / "config", {"ml": (cluster.url, "t-env")}, "ml")
    monkeypatch.setenv("KUBECONFIG", str(path))
    api = Api(read())
    assert lists(api)
    assert cluster.emulator is not None
    assert cluster.emulator.authorization == "Bearer t-env"


def test_no_credentials_at_all_say_what_to_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match="no credentials found") as refused:
        credentials(read())
    assert "Set kubeconfig (and context) or api_url in [agent.kubernetes]" in str(refused.value)


# In a pod: the service account's token and CA, the API server's address from the environment ------------


def certificate_authority(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 it signed, as a cluster's API server has."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(tz=datetime.UTC)

    def issued(subject: str, public: Any, issuer: str, signer: Any, *, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    authority = issued("kubernetes-ca", ca_key.public_key(), "kubernetes-ca", ca_key, ca=True)
    server = issued("kube-apiserver", key.public_key(), "kubernetes-ca", ca_key, ca=False)
    paths = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    paths[0].write_bytes(authority.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


class TlsFront:
    """TLS in front of the emulator, as an API server serves it: bytes piped both ways."""

    def __init__(self, backend_port: int, certificate: Path, key: Path) -> None:
        self.backend_port, self.port = backend_port, 0
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certificate, key)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            server = await asyncio.start_server(self._pipe, "127.0.0.1", 0, ssl=self.context)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            async with server:
                await server.serve_forever()

        threading.Thread(target=self.loop.run_until_complete, args=(serve(),), daemon=True).start()
        assert ready.wait(10)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
            sink.close()

        both = copy(reader, upstream_writer), copy(upstream_reader, writer)
        await asyncio.gather(*both, return_exceptions=True)


def test_in_a_pod_the_service_account_is_used_over_tls_and_its_rotated_token_read_again(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca, certificate, key = certificate_authority(tmp_path)
    front = TlsFront(int(cluster.url.rsplit(":", 1)[1]), certificate, key)
    token = tmp_path / "token"
    token.write_text("first-token")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    # The client reads the token again once a minute; here at once, so that a rotation shows.
    clock = types.SimpleNamespace(timedelta=lambda **_: datetime.timedelta(0), datetime=datetime.datetime)
    monkeypatch.setattr(incluster_config, "datetime", clock)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(front.port))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "never-read"))

    api = Api(read())
    assert api.where == f"https://127.0.0.1:{front.port}"
    assert lists(api)
    assert cluster.emulator is not None
    assert cluster.emulator.authorization == "bearer first-token"
    token.write_text("rotated-token")  # the kubelet rotates a projected token in place
    assert lists(api)
    assert cluster.emulator.authorization == "bearer rotated-token"


def test_in_a_pod_an_api_server_without_the_clusters_ca_is_refused(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, certificate, key = certificate_authority(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    stranger_ca = certificate_authority(other)[0]  # a CA that did not sign the server's certificate
    front = TlsFront(int(cluster.url.rsplit(":", 1)[1]), certificate, key)
    token = tmp_path / "token"
    token.write_text("a-token")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(stranger_ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(front.port))
    api = Api(read())
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        api.listing("Job")
