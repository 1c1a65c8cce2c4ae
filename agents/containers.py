"""The container mode of the bare-metal backend: a task whose spec names an `image` runs in a container of
the host's own engine (podman or docker), started by the task's runner (agents.runner) in the foreground,
so that its output streams to the task's log and its exit code is the task's.

What the container gets:

- the task's folder (or its code's folder) at /work, the working directory;
- the shared file system at the same path as on the host, where the agent is given one (--shared-path);
- the task's GPUs, the way each engine takes them: CDI device names for podman (`nvidia.com/gpu=0`, a
  MIG slice by its UUID), `--gpus device=...` for docker. Inside, the devices are numbered from 0, so
  CUDA_VISIBLE_DEVICES is set to match. A configured inventory (tests, demos: `--gpus N` where NVML
  finds none) has no devices to pass; the container gets none and the log says so;
- the task's variables and secrets by name only (`-e NAME`): the engine reads their values from its own
  environment, which the runner gives it, never from its command line.

Images are not pulled unless the operator allows it (KLIQUE_IMAGE_PULL=missing in the agent's
environment): machines without a registry run images built on the host or loaded from an archive. Given
a folder of archives (--image-archives DIR: `docker save` or `podman save` files, `.tar` or compressed),
the agent loads the one that holds a missing image, found by the names in its manifest. A task whose
image is on neither fails at once, its reason naming the image.
A container runs with no capabilities and cannot gain privileges (no setuid): its root is the task's own
user in all but name, and cannot override the permissions of the shared file system or other tasks'
files. The operator may grant a few back to every container (KLIQUE_CONTAINER_CAPABILITIES, from an
allow-list: IPC_LOCK for RDMA, SYS_PTRACE for profilers, SYS_NICE, KILL).
A gateway address the container is handed (an agent session's OPENAI_BASE_URL) whose host is a name
under `.localhost` (a demo's tenant: RFC 6761 keeps those names on the loopback, which the image's own
resolver may not know) is written into the container's /etc/hosts as 127.0.0.1, the host's loopback
on the host's network.
The operator may pick the engine with KLIQUE_CONTAINER_ENGINE (a name or a path); else the first of
docker and podman that answers is used. Each container is named for its task (`klique-<task>`), so the
agent can remove one whose runner was killed before the engine could (agents.baremetal).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from protocol import images, sessions

__all__ = [
    "ENGINE_CODES",
    "PULL_POLICIES",
    "container_name",
    "engine",
    "image_present",
    "pull_policy",
    "remove",
    "run_argv",
]

PULL_POLICIES = ("never", "missing")
ENGINE_FAILED = 125  # docker's and podman's exit code when the engine, not the command, failed
CANNOT_START = 126  # theirs when the container (its devices, its runtime) or its command could not start
ENGINE_CODES = {
    ENGINE_FAILED: "The container engine could not run the task's image (exit code 125); its log says why.",
    CANNOT_START: "The task's container could not be started (exit code 126: its devices, its runtime or "
    "its command); its log says why.",
}
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


def engine() -> str | None:
    """The container engine to use: the operator's choice (KLIQUE_CONTAINER_ENGINE), else the first of
    docker and podman whose service answers; None where none does."""
    chosen = os.environ.get("KLIQUE_CONTAINER_ENGINE", "").strip()
    for name in [chosen] if chosen else ["docker", "podman"]:
        path = shutil.which(name)
        if path and _quiet([path, "info"]) == 0:
            return path
    return None


def pull_policy() -> str:
    policy = os.environ.get("KLIQUE_IMAGE_PULL", "never").strip() or "never"
    if policy not in PULL_POLICIES:
        raise ValueError(f"KLIQUE_IMAGE_PULL is {policy!r}; use one of {', '.join(PULL_POLICIES)}.")
    return policy


def container_name(task_id: str) -> str:
    return "klique-" + _NAME_UNSAFE.sub("-", task_id)[:100]


def image_present(engine_path: str, image: str) -> bool:
    return _quiet([engine_path, "image", "inspect", "--format", "{{.Id}}", image]) == 0


MAX_MANIFEST = 1024 * 1024  # an archive's manifest.json is a few hundred bytes; more is not one


def _canonical(reference: str) -> str:
    """A reference as both engines' archives name it: docker.io's own prefixes dropped, a tag always."""
    for prefix in ("docker.io/library/", "docker.io/"):
        reference = reference.removeprefix(prefix)
    last = reference.rsplit("/", 1)[-1]
    return reference if ":" in last or "@" in last else f"{reference}:latest"


def archive_names(archive: Path) -> list[str]:
    """The image names a `docker save` / `podman save` archive holds (its manifest.json's RepoTags); none
    where it is not such an archive."""
    try:
        with tarfile.open(archive) as bundle:
            member = bundle.getmember("manifest.json")
            if not member.isfile() or member.size > MAX_MANIFEST:
                return []
            handle = bundle.extractfile(member)
            manifest = json.loads(handle.read()) if handle is not None else []
    except (OSError, KeyError, tarfile.TarError, ValueError, EOFError):
        return []
    if not isinstance(manifest, list):
        return []
    return [
        str(tag)
        for entry in manifest
        if isinstance(entry, dict) and isinstance(entry.get("RepoTags"), list)
        for tag in entry["RepoTags"]
    ]


def archive_holding(folder: Path, image: str) -> Path | None:
    """The first archive in `folder` (by name) that holds `image`, or None."""
    wanted = _canonical(image)
    if not folder.is_dir():
        return None
    for archive in sorted(folder.iterdir()):
        if archive.is_file() and any(_canonical(name) == wanted for name in archive_names(archive)):
            return archive
    return None


def _is_podman(engine_path: str) -> bool:
    return Path(engine_path).name.startswith("podman")


def gpu_arguments(engine_path: str, devices: list[str]) -> list[str]:
    """How `engine_path` is given the host's `devices` (indices, or MIG UUIDs)."""
    if not devices:
        return []
    if _is_podman(engine_path):
        return [word for device in devices for word in ("--device", f"nvidia.com/gpu={device}")]
    return ["--gpus", f"device={','.join(devices)}"]


CAPABILITIES_VARIABLE = "KLIQUE_CONTAINER_CAPABILITIES"
CAPABILITY = re.compile(r"(CAP_)?[A-Z][A-Z0-9_]{1,30}")
# Those the operator may grant back (each one named in KLIQUE_CONTAINER_CAPABILITIES): what GPU work asks
# for, and none that reaches past the container. IPC_LOCK (RDMA memory registration), SYS_PTRACE
# (debuggers, profilers: within the container's processes), SYS_NICE, KILL (within the container). Not
# CHOWN, FOWNER, DAC_* or SETUID/SETGID: on a rootful engine they would reach other users' files on the
# shared file system; not NET_BIND_SERVICE: with the host's network, the host's low ports.
GRANTABLE = frozenset({"IPC_LOCK", "SYS_PTRACE", "SYS_NICE", "KILL"})


def capabilities(value: str) -> tuple[list[str], str]:
    """The capabilities an operator grants back to every container (a comma list), and what in the list
    is not one of GRANTABLE."""
    granted, refused = [], []
    for word in (part.strip().upper() for part in value.split(",") if part.strip()):
        name = word.removeprefix("CAP_")
        if CAPABILITY.fullmatch(word) and name in GRANTABLE:
            granted.append(name)
        else:
            refused.append(word[:40])
    return sorted(set(granted)), ", ".join(refused)


def run_argv(
    engine_path: str,
    *,
    image: str,
    task_id: str,
    workdir: Path,
    passed: Mapping[str, str],
    runner_environment: Mapping[str, str],
) -> tuple[list[str], list[str]]:
    """The engine's command line that runs the task's command (appended after it) in `image`, and the lines
    to write to the task's log about it. `runner_environment` is the runner's own (the agent's and
    Klique's): the GPUs it was given, the shared file system, whether the GPUs are real. The image is on
    the host by now (agents.environment loads or pulls it first), so the run never pulls."""
    notes: list[str] = []
    host_devices = [d for d in runner_environment.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    real = runner_environment.get("KLIQUE_GPU_SOURCE") == "nvml"
    devices = host_devices if real else []
    if host_devices and not real:
        notes.append(
            "klique: this host's GPUs are a configured inventory (no NVIDIA devices), so the container is "
            "given none"
        )
    argv = [
        engine_path, "run", "--rm", "--pull=never", "--init",
        "--name", container_name(task_id),
        "--network", "host",
        "--cap-drop=ALL", "--security-opt=no-new-privileges",
        "-v", f"{workdir}:/work", "-w", "/work",
    ]  # fmt: skip
    granted, refused = capabilities(runner_environment.get(CAPABILITIES_VARIABLE, ""))
    argv += [f"--cap-add={name}" for name in granted]
    if refused:
        notes.append(f"klique: {CAPABILITIES_VARIABLE} names what is not a capability, left out: {refused}")
    shared = runner_environment.get("KLIQUE_SHARED_PATH", "")
    if shared:
        if ":" in shared or "," in shared:
            notes.append(
                f"klique: the shared file system's path {shared} holds ':' or ',' and cannot be mounted"
            )
        elif Path(shared).is_dir():
            argv += ["-v", f"{shared}:{shared}"]
        else:
            notes.append(f"klique: the shared file system {shared} is not on this host; not mounted")
    argv += gpu_arguments(engine_path, devices)
    if devices:  # inside, the devices the engine passed are numbered from 0
        argv += ["-e", "CUDA_VISIBLE_DEVICES=" + ",".join(str(index) for index in range(len(devices)))]
    else:
        argv += ["-e", "CUDA_VISIBLE_DEVICES"]
    argv += [f"--add-host={host}:127.0.0.1" for host in loopback_names(passed)]
    names = ["KLIQUE_TASK_ID", "KLIQUE_GPU_MEMORY_FRACTION", *sorted(passed)]
    argv += [word for name in names for word in ("-e", name)]  # by name: values never on a command line
    argv += ["--", images.engine_reference(image)]
    return argv, notes


LOOPBACK_NAME = re.compile(r"(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*localhost")


def loopback_names(passed: Mapping[str, str]) -> list[str]:
    """The `.localhost` host of the gateway address the container is handed, if that is what it names."""
    host = (urlsplit(passed.get(sessions.BASE_VARIABLE, "")).hostname or "").lower()
    return [host] if host != "localhost" and LOOPBACK_NAME.fullmatch(host) else []


def remove(engine_path: str, task_id: str) -> None:
    """Remove the task's container if it is still there (its runner was killed before the engine could)."""
    if not task_id:
        return
    force = ["rm", "--force", "--time", "0"] if _is_podman(engine_path) else ["rm", "--force"]
    _quiet([engine_path, *force, container_name(task_id)])


def _quiet(argv: list[str]) -> int:
    try:
        return subprocess.call(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return -1
