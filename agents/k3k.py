"""The kubeconfig the Kubernetes agent gives a K3k clustering service's app (protocol.clusters).

The K3k controller keeps each virtual cluster's certificate authorities in its bootstrap Secret (key
`bootstrap`: JSON with `serverCA`, `clientCA` and `clientCAKey`, each `{"Timestamp", "Content"}`, the
content PEM). The agent signs a client certificate of the cluster's administrator with the client CA, as
`k3kcli kubeconfig generate` does, and writes a kubeconfig that trusts the server CA alone. The key is
made here and leaves the agent only in the run's own Secret.
"""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import Mapping
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protocol import clusters

CERTIFICATE_DAYS = 365  # as long as K3s' own client certificates
_SIGNING_ONLY = x509.KeyUsage(
    digital_signature=True, key_encipherment=False, content_commitment=False, data_encipherment=False,
    key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
)  # fmt: skip


class BootstrapUnreadable(ValueError):
    """The controller's bootstrap Secret does not hold what a kubeconfig is made from (yet)."""


def _pem(bootstrap: Mapping[str, Any], key: str) -> bytes:
    entry = bootstrap.get(key)
    content = entry.get("Content") if isinstance(entry, dict) else None
    if not isinstance(content, str) or "-----BEGIN" not in content:
        raise BootstrapUnreadable(f"the cluster's bootstrap Secret has no {key} in PEM")
    return content.encode()


def admin_kubeconfig(bootstrap_json: str, *, server: str, name: str) -> str:
    """A kubeconfig for the cluster's API at `server`, as its administrator. Raises BootstrapUnreadable."""
    try:
        bootstrap = json.loads(bootstrap_json)
    except ValueError:
        raise BootstrapUnreadable("the cluster's bootstrap Secret is not JSON") from None
    if not isinstance(bootstrap, dict):
        raise BootstrapUnreadable("the cluster's bootstrap Secret is not a JSON object")
    server_ca = _pem(bootstrap, "serverCA")
    try:
        authority = x509.load_pem_x509_certificate(_pem(bootstrap, "clientCA"))
        authority_key = serialization.load_pem_private_key(_pem(bootstrap, "clientCAKey"), password=None)
        x509.load_pem_x509_certificate(server_ca)
    except ValueError as error:
        raise BootstrapUnreadable(f"the cluster's certificate authorities cannot be read: {error}") from None
    if not isinstance(authority_key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise BootstrapUnreadable("the cluster's client CA key is neither EC nor RSA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, clusters.ADMIN_GROUP),
            x509.NameAttribute(NameOID.COMMON_NAME, clusters.ADMIN_NAME),
        ]
    )
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(authority.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_SIGNING_ONLY, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(authority_key, hashes.SHA256())
    )
    chain = certificate.public_bytes(serialization.Encoding.PEM) + authority.public_bytes(
        serialization.Encoding.PEM
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )

    def encoded(data: bytes) -> str:
        return base64.b64encode(data).decode()

    cluster = {"server": server, "certificate-authority-data": encoded(server_ca)}
    user = {"client-certificate-data": encoded(chain), "client-key-data": encoded(key_pem)}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": "admin", "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": "admin"}}],
        "current-context": name,
    }
    return yaml.safe_dump(config, sort_keys=False)
