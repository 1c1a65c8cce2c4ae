"""A real podman for the bare-metal backend's container mode (deploy/containers/podman.sh: Debian's podman
with runc, a tiny image built from Debian's static busybox, no registry). Loaded as a plugin by
tests/conftest.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS_DIR = Path("/tmp/klique-containers")  # noqa: S108 -- one engine per machine, as its images are
IMAGE = "localhost/klique-busybox:1"


@dataclass(frozen=True)
class Podman:
    engine: str
    image: str  # a small image the engine holds: busybox's sh, echo, cat, env, sleep, ...

    def run(self, *arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.engine, *arguments], capture_output=True, text=True, timeout=120, check=False
        )


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    """Podman installed and configured for this machine (CONTAINERS_CONF is set for this process and the
    agents and runners it starts), holding IMAGE. Docker's client, if present, has no service here."""
    if os.geteuid() != 0:
        pytest.skip("installing podman (apt-get) and running its containers here needs root")
    done = subprocess.run(
        ["bash", str(ROOT / "deploy" / "containers" / "podman.sh"), "setup", str(CONTAINERS_DIR), IMAGE],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    previous = {name: os.environ.get(name) for name in ("CONTAINERS_CONF", "KLIQUE_CONTAINER_ENGINE")}
    os.environ["CONTAINERS_CONF"] = done.stdout.strip().splitlines()[-1]
    os.environ["KLIQUE_CONTAINER_ENGINE"] = "podman"
    yield Podman("podman", IMAGE)
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def shipped_images(podman: Podman) -> Podman:
    """The images the shipped catalogue entries name (JupyterLab's, the agent sandbox's), built on this
    host by the project's own script (deploy/apps/images.sh: Debian's packages and PyPI, no registry)."""
    done = subprocess.run(
        ["bash", str(ROOT / "deploy" / "apps" / "images.sh"), str(CONTAINERS_DIR), "all"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return podman
