"""A real single-node Slurm for the HPC tests (deploy/slurm/single-node.sh: four fake GPUs, slurmdbd on
the machine's MariaDB for sacct, the PBS wrappers of slurm-wlm-torque), Linux accounts for Klique users,
and a jobs folder those accounts can reach. Loaded as a plugin by tests/conftest.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM_DIR = Path("/tmp/klique-slurm")  # noqa: S108 -- one Slurm per machine: its ports are fixed
ACCOUNTS = ("kqalice", "kqbob")


@pytest.fixture(scope="session")
def slurm() -> Iterator[Path]:
    """The slurm.conf of a running single-node Slurm, also set as SLURM_CONF for this process."""
    if os.geteuid() != 0:
        pytest.skip("a single-node Slurm needs root to start (munge, slurmd)")
    started = subprocess.run(
        ["bash", str(ROOT / "deploy" / "slurm" / "single-node.sh"), "start", str(SLURM_DIR)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    conf = Path(started.stdout.strip().splitlines()[-1])
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    yield conf
    subprocess.run(
        ["bash", str(ROOT / "deploy" / "slurm" / "single-node.sh"), "stop", str(SLURM_DIR)], check=False
    )
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


@pytest.fixture(scope="session")
def accounts() -> tuple[str, ...]:
    """Linux accounts Klique users map to (created once per machine)."""
    for account in ACCOUNTS:
        if subprocess.run(["id", account], capture_output=True, check=False).returncode:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/bash", account], check=True)
    return ACCOUNTS


@pytest.fixture
def jobs_dir() -> Iterator[Path]:
    """A jobs folder the accounts can reach (pytest's tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="klique-jobs-", dir="/tmp"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
