"""The deployment files agree with the code. No container engine runs on the test machines, so these
check the contract (commands the CLI accepts, variables the settings read, files the image copies)
rather than starting the containers."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from klique.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
CONFIG_SOURCE = "\n".join(path.read_text() for path in (ROOT / "config").rglob("*.py"))


def test_every_klique_service_runs_a_command_the_cli_accepts() -> None:
    commands = [service["command"] for service in COMPOSE["services"].values() if "command" in service]
    assert {command[1] for command in commands} == {"migrate", "web", "worker", "beat"}
    for command in commands:
        assert command[0] == "klique"
        build_parser().parse_args(command[1:])


def test_every_variable_compose_sets_is_read_by_the_settings() -> None:
    environment = COMPOSE["x-klique"]["environment"]
    for name in environment:
        assert re.search(rf'"{name}"', CONFIG_SOURCE), f"{name} is set in compose.yaml but never read"


def test_the_image_copies_every_package_the_server_needs() -> None:
    import tomllib

    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+?)/? ", dockerfile, flags=re.MULTILINE))
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = [pattern.rstrip("*") for pattern in found["include"] if (ROOT / pattern.rstrip("*")).is_dir()]
    for package in (*packages, "requirements", "frontend/templates", "frontend/static"):
        assert package in copied, f"the image does not copy {package}/"
    assert "COPY --from=assets /frontend/node_modules/ frontend/node_modules/" in dockerfile  # htmx, Chart.js
    assert "config.settings.production" in dockerfile
    assert "install -y -qq --no-install-recommends postgresql-client" in dockerfile  # pg_dump: the template


def test_the_slurm_script_is_valid_shell() -> None:
    import subprocess

    script = ROOT / "deploy" / "slurm" / "single-node.sh"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stderr
