"""Checks made before a Klique process starts, so a bad address fails in one sentence, not a traceback."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


class PreflightError(RuntimeError):
    """A service Klique needs is not configured or not reachable; the message says what to fix."""


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _unix_reachable(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(2)
        try:
            client.connect(str(path))
            return True
        except OSError:
            return False


def check_database() -> None:
    url = os.environ.get("DATABASE_URL", "").strip()
    if not url:
        raise PreflightError(
            "DATABASE_URL is not set. Point it at PostgreSQL (postgres://user@host:5432/db), "
            "or use `klique up`, which starts an embedded PostgreSQL when none is configured."
        )
    parts = urlsplit(url)
    socket_dir = parse_qs(parts.query).get("host", [""])[0] or (parts.hostname or "")
    if socket_dir.startswith("/"):
        path = Path(socket_dir) / f".s.PGSQL.{parts.port or 5432}"
        if not _unix_reachable(path):
            raise PreflightError(f"PostgreSQL is not listening on {path}. Start it or fix DATABASE_URL.")
        return
    host, port = parts.hostname or "localhost", parts.port or 5432
    if not _reachable(host, port):
        raise PreflightError(
            f"Cannot reach PostgreSQL at {host}:{port} (from DATABASE_URL). Start it, or fix DATABASE_URL."
        )


def check_redis() -> None:
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").strip()
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not _unix_reachable(Path(parts.path)):
            raise PreflightError(f"Redis is not listening on {parts.path}. Start it or fix REDIS_URL.")
        return
    host, port = parts.hostname or "localhost", parts.port or 6379
    if not _reachable(host, port):
        raise PreflightError(
            f"Cannot reach Redis at {host}:{port} (from REDIS_URL). Start it, or fix REDIS_URL."
        )
