"""The import contracts of `make lint` (pyproject.toml's [tool.importlinter], docs/architecture.md) hold
on the code as it is, and fail on a copy of it given one breach of each kind."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("apps", "gateway", "tenants", "config", "protocol", "agents", "klique", "tools")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CYCLE = "No module takes part in an import cycle"
PACKAGES_CYCLE = "No two packages import each other"
PUBLIC = "only through their public modules"


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's packages and pyproject.toml in a folder of their own, for breaking on purpose."""
    target = tmp_path_factory.mktemp("layers")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, target / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", target / "pyproject.toml")
    return target


def lint(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_the_contracts_hold_on_the_code_as_it_is() -> None:
    checked = lint(ROOT)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "0 broken" in checked.stdout


BREACHES = [
    # A cycle of modules, through an import at the top of a file ...
    (
        "apps/scheduling/runs.py",
        "from apps.scheduling import lifecycle\n",
        CYCLE,
    ),
    # ... and through one hidden inside a function
    (
        "apps/scheduling/wake.py",
        "\n\ndef _hidden() -> None:\n    from apps.scheduling import lifecycle\n",
        CYCLE,
    ),
    # Two packages round a cycle, though no module is in one: metering's exports would need scheduling,
    # whose run metering needs metering ...
    ("apps/metering/exports.py", "from apps.scheduling import wake\n", PACKAGES_CYCLE),
    # ... and the same through a module its package counts as a package of its own
    ("apps/scheduling/engine/units.py", "import apps.accounts.models\n", PACKAGES_CYCLE),
    # An app reaching into another's internals, downwards and with no cycle
    ("apps/billing/services.py", "from apps.metering import exports\n", PUBLIC),
    ("apps/portal/dashboard.py", "from apps.fleet import dispatch\n", PUBLIC),
    ("protocol/units.py", "import django\n", "protocol is pure"),
    ("apps/metering/services.py", "from rest_framework import serializers\n", "the project's own errors"),
    (
        "apps/scheduling/engine/units.py",
        "from apps.scheduling import models\n",
        "engine is pure",
    ),
    (
        "agents/state.py",
        "from django.conf import settings\n",
        "Agents and the SDK",
    ),
    ("klique/sdk.py", "import apps.core.ids\n", "Agents and the SDK"),
    (
        "apps/configuration/services.py",
        "import agents.node\n",
        "The plane never imports the agents",
    ),
    (
        "apps/metering/selectors.py",
        "from apps.metering import apis\n",
        "never reach up into the web",
    ),
]


@pytest.mark.parametrize(("module", "line", "contract"), BREACHES, ids=[breach[0] for breach in BREACHES])
def test_a_breach_fails_its_contract(copy: Path, module: str, line: str, contract: str) -> None:
    target = copy / module
    kept = target.read_text()
    try:
        target.write_text(line + kept if not line.startswith("\n") else kept + line)
        checked = lint(copy)
    finally:
        target.write_text(kept)
    assert checked.returncode != 0
    broken = checked.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, checked.stdout  # (a breach may break others too: protocol's reaches agents)


def test_the_copy_is_whole_again(copy: Path) -> None:
    """Each breach was undone: the copy passes as the code does (so each failure above was the breach's)."""
    assert lint(copy).returncode == 0
