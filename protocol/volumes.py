"""The volumes a task declares (`spec.volumes`), by name, out of those its pool's agent offers.

A task never says what to mount: an administrator lists the volumes a pool offers in the agent's
configuration (a name, the path in the task's container, read-only or not, and where it comes from),
and a task names the ones it wants, `["datasets", {"name": "checkpoints", "read_only": true}]`. A task
may make a volume read-only for itself, never writable where the pool offers it read-only. Checked when
the task is submitted (the form) and by the agent before it starts the task (that the pool offers each).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

NAME = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,38}[a-z0-9])?")  # a DNS label, short enough for a prefix
MAX_VOLUMES = 16
RESERVED_PATHS = ("/klique-work", "/scratch")  # the task's folder and its scratch, where Klique mounts


class VolumeRefused(ValueError):
    """A declaration that cannot be honoured, in words for the person who wrote it."""


@dataclass(frozen=True)
class Wanted:
    name: str
    read_only: bool = False


@dataclass(frozen=True)
class Offered:
    """One volume a pool offers: mounted at `path`; `source` is the cluster's volume source."""

    name: str
    path: str
    read_only: bool
    source: Mapping[str, object]


def wanted(value: object) -> list[Wanted]:
    """The task's declaration, checked for form; raises VolumeRefused."""
    if value in (None, []):
        return []
    if not isinstance(value, list):
        raise VolumeRefused('spec.volumes must be a list of volume names, e.g. ["datasets"].')
    if len(value) > MAX_VOLUMES:
        raise VolumeRefused(f"spec.volumes names {len(value)} volumes; at most {MAX_VOLUMES}.")
    found: list[Wanted] = []
    for item in value:
        if isinstance(item, str):
            name, read_only = item, False
        elif isinstance(item, dict) and set(item) <= {"name", "read_only"} and "name" in item:
            name, read_only = item["name"], item.get("read_only", False)
            if not isinstance(read_only, bool):
                raise VolumeRefused(f"spec.volumes: read_only of {name!r} must be true or false.")
        else:
            raise VolumeRefused(
                'spec.volumes: each entry is a name or {"name": ..., "read_only": true}, '
                f"not {str(item)[:80]!r}."
            )
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise VolumeRefused(
                f"spec.volumes: {str(name)[:80]!r} is not a volume name (lowercase letters, digits and "
                "dashes, at most 40)."
            )
        if any(earlier.name == name for earlier in found):
            raise VolumeRefused(f"spec.volumes names {name!r} twice.")
        found.append(Wanted(name, read_only))
    return found


def offered(table: Mapping[str, object]) -> dict[str, Offered]:
    """The agent's `volumes` table: {name: {path, read_only (default true), source}}; raises ValueError
    (TypeError for a read_only that is not a boolean)."""
    found: dict[str, Offered] = {}
    paths: set[str] = set()
    for name, entry in table.items():
        if not NAME.fullmatch(str(name)):
            raise ValueError(f"volumes.{name}: not a volume name (lowercase letters, digits, dashes).")
        if not isinstance(entry, Mapping) or set(entry) - {"path", "read_only", "source"}:
            raise ValueError(f"volumes.{name}: takes path, read_only and source.")
        path, read_only, source = entry.get("path"), entry.get("read_only", True), entry.get("source")
        if not isinstance(path, str) or not _plain_absolute(path):
            raise ValueError(f"volumes.{name}: path must be an absolute path without '..', not {path!r}.")
        if any(path == reserved or path.startswith(f"{reserved}/") for reserved in RESERVED_PATHS):
            raise ValueError(f"volumes.{name}: {path} is where Klique mounts the task's own folders.")
        if path in paths:
            raise ValueError(f"volumes.{name}: another volume is mounted at {path}.")
        if not isinstance(read_only, bool):
            raise TypeError(f"volumes.{name}: read_only must be true or false.")
        if not isinstance(source, Mapping) or len(source) != 1:
            raise ValueError(
                f"volumes.{name}: source must be one volume source, e.g. "
                '{ persistentVolumeClaim = { claimName = "imagenet" } }.'
            )
        paths.add(path)
        found[str(name)] = Offered(str(name), path, read_only, dict(source))
    return found


def chosen(declared: list[Wanted], offers: Mapping[str, Offered]) -> list[tuple[Offered, bool]]:
    """Each declared volume the pool offers, with whether it is mounted read-only; raises VolumeRefused
    naming a volume the pool does not offer."""
    missing = [want.name for want in declared if want.name not in offers]
    if missing:
        has = ", ".join(sorted(offers)) or "none"
        raise VolumeRefused(
            f"The task asks for volume {missing[0]!r}, which this pool does not offer (it offers: {has}). "
            "Submit it to a compute resource whose pools offer it, or ask an administrator to add it to "
            "the agent's volumes."
        )
    return [(offers[want.name], offers[want.name].read_only or want.read_only) for want in declared]


def _plain_absolute(path: str) -> bool:
    parts = path.split("/")
    return (
        path.startswith("/")
        and path != "/"
        and len(path) <= 512
        and ".." not in parts
        and "." not in parts[1:]
        and not any(ord(c) < 32 or c in ":\\" for c in path)
    )
