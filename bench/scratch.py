"""A throwaway Klique for benchmarks: a fresh database on the machine's PostgreSQL, migrated, with the demo
tenant; dropped afterwards."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
from cryptography.fernet import Fernet

ROOT = Path(__file__).resolve().parent.parent
ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
KLIQUE = [sys.executable, "-m", "klique.cli"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def scratch_klique(*, redis_db: int, **settings: str) -> Iterator[tuple[dict[str, str], dict[str, Any]]]:
    """The environment for Klique's processes, and what demo_setup printed (tokens, the tenant's address)."""
    database = f"klique_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{database}"')
    environment = {
        **os.environ,
        "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{database}",
        "REDIS_URL": f"redis://127.0.0.1:6379/{redis_db}",
        "DJANGO_SETTINGS_MODULE": "config.settings.production",
        "SECRET_KEY": uuid.uuid4().hex * 2,
        "KLIQUE_LOG_LEVEL": "WARNING",
        "KLIQUE_MASTER_KEYS": Fernet.generate_key().decode(),  # production settings require a vault key
        **settings,
    }
    try:
        subprocess.run([*KLIQUE, "migrate"], env=environment, check=True, capture_output=True, cwd=ROOT)
        printed = subprocess.run(
            [*KLIQUE, "manage", "demo_setup"],
            env=environment,
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout
        yield environment, json.loads(printed.strip().splitlines()[-1])
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


@contextmanager
def scratch_django(*, redis_db: int) -> Iterator[dict[str, Any]]:
    """A scratch Klique with Django set up on it in this process (for benchmarks that call Klique's code
    directly); yields what demo_setup printed."""
    with scratch_klique(redis_db=redis_db) as (environment, demo):
        names = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "SECRET_KEY", "KLIQUE_MASTER_KEYS")
        os.environ.update({key: environment[key] for key in names})
        sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        yield demo


@contextmanager
def klique_web(environment: dict[str, str], port: int) -> Iterator[str]:
    """A `klique web` process on `port`, answering /healthz; yields its base address, stops it after."""
    web = subprocess.Popen(
        [*KLIQUE, "web", "--port", str(port)],
        env=environment,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield base
    finally:
        web.terminate()
        web.wait(timeout=30)


def dispatch_latency(database_url: str, name_pattern: str) -> tuple[float, float]:
    """Submit-to-dispatch p50 and p99, in seconds, of the demo tenant's tasks whose names are LIKE
    `name_pattern`: from each task's own events (queued, then dispatching). NaN where none was dispatched."""
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            """SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM d.at - q.at)),
                      percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM d.at - q.at))
                 FROM demo.scheduling_task t
                 JOIN demo.scheduling_taskevent q ON q.task_id = t.id AND q.to_state = 'queued'
                 JOIN demo.scheduling_taskevent d ON d.task_id = t.id AND d.to_state = 'dispatching'
                WHERE t.name LIKE %s""",
            [name_pattern],
        ).fetchone()
    assert row is not None
    return float(row[0] if row[0] is not None else "nan"), float(row[1] if row[1] is not None else "nan")
