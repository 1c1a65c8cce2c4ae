"""Configuration errors and unreachable services stop start-up with a sentence that says what to fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config import env

ROOT = Path(__file__).resolve().parent.parent
KLIQUE = [sys.executable, "-m", "klique.cli"]


def run_klique(*arguments: str, **environment: str) -> subprocess.CompletedProcess[str]:
    base = {key: value for key, value in os.environ.items() if key not in {"DATABASE_URL", "REDIS_URL"}}
    base.pop("DJANGO_SETTINGS_MODULE", None)
    return subprocess.run(
        [*KLIQUE, *arguments],
        env={**base, **environment},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )


def test_missing_database_url_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with pytest.raises(env.ConfigError, match=r"DATABASE_URL is not set.*klique up"):
        env.database_url()


def test_a_database_that_is_not_postgresql_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "mysql://root@127.0.0.1/klique")
    with pytest.raises(env.ConfigError, match="Klique needs PostgreSQL"):
        env.database_url()


@pytest.mark.parametrize(
    ("name", "value", "reader", "fragment"),
    [
        ("REDIS_URL", "http://cache:80", env.redis_url, "not a Redis URL"),
        ("DEBUG", "perhaps", lambda: env.flag("DEBUG", default=False), "not a boolean"),
        (
            "KLIQUE_TOKEN_DEFAULT_DAYS",
            "ninety",
            lambda: env.integer("KLIQUE_TOKEN_DEFAULT_DAYS", default=1),
            "whole",
        ),
    ],
)
def test_malformed_values_are_named(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, reader, fragment: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(env.ConfigError, match=fragment):
        reader()


def test_redis_unix_socket_is_translated_for_celery() -> None:
    assert env.celery_broker_url("unix:///tmp/r.sock") == "redis+socket:///tmp/r.sock"
    assert env.celery_broker_url("redis://h:6379/2") == "redis://h:6379/2"


def test_web_refuses_to_start_without_a_database_url() -> None:
    result = run_klique("web", "--port", "18999")
    assert result.returncode == 2
    assert "DATABASE_URL is not set" in result.stderr
    assert "Traceback" not in result.stderr


def test_web_names_the_unreachable_database() -> None:
    result = run_klique("web", DATABASE_URL="postgres://klique@127.0.0.1:1/klique")
    assert result.returncode == 2
    assert "Cannot reach PostgreSQL at 127.0.0.1:1" in result.stderr


def test_worker_names_the_unreachable_redis() -> None:
    result = run_klique(
        "worker",
        DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres",
        REDIS_URL="redis://127.0.0.1:1/0",
    )
    assert result.returncode == 2
    assert "Cannot reach Redis at 127.0.0.1:1" in result.stderr


def test_sdk_and_cli_import_no_django() -> None:
    """`klique` and `agents` run where only the [agent] extra is installed; the engine is pure."""
    probe = (
        "import sys, klique.cli, klique.embedded, klique.preflight, klique.sdk, agents, "
        "apps.scheduling.engine, apps.scheduling.engine.simulate; print('django' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert result.stdout.strip() == "False", result.stderr


def test_agent_extra_installs_without_django(tmp_path: Path) -> None:
    """What `pip install 'klique[agent]'` would install, resolved against the registry."""
    report = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            f"{ROOT}[agent]",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"klique", "websockets", "httpx"} <= names
    assert not names & {"django", "djangorestframework", "django-tenants", "celery", "psycopg"}


def test_up_names_the_unreachable_database(tmp_path: Path) -> None:
    result = run_klique(
        "up",
        "--data-dir",
        str(tmp_path),
        DATABASE_URL="postgres://klique@127.0.0.1:1/klique",
        REDIS_URL="redis://127.0.0.1:6379/13",
    )
    assert result.returncode == 2
    assert "Cannot reach PostgreSQL at 127.0.0.1:1" in result.stderr
    assert "Traceback" not in result.stderr
