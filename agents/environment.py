"""Rebuilding a task's environment before its command runs (inside agents.runner, so it survives a crash
of the agent). The spec may name:

    "code":         {"git": URL, "commit": SHA or ref} (cloned into the task's folder as src/), or
                    {"path": "/a/local/folder"} (used where it is)
    "requirements": ["package==1.0", ...] and/or "requirements_file": "requirements.txt" (in the code):
                    installed into a virtual environment cached by their hash, shared by the tasks that
                    ask for the same set
    "image":        a container image the host holds: the command runs in it (agents.containers)

Every step writes its output to the task's log, so a task whose environment cannot be built fails with
the build log attached.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from agents import containers
from protocol import images

BUILD_FAILED = 97  # the exit code of a task whose environment could not be built


class BuildFailed(Exception):
    """A step of the environment failed; its output is in the log already."""


@dataclass
class Environment:
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # put before the command (a container engine's run)


def _run(argv: list[str], log: IO[bytes], *, cwd: Path | None = None, what: str) -> None:
    log.write(f"klique: {what}: {' '.join(argv)}\n".encode())
    log.flush()
    code = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)
    if code != 0:
        raise BuildFailed(f"{what} failed with exit code {code}")


def build(
    spec: dict[str, Any], folder: Path, cache: Path, log: IO[bytes], passed: Mapping[str, str] | None = None
) -> Environment:
    """How the task's command runs: its folder, the variables of its virtual environment and a container
    engine's prefix. `passed` is the task's own variables, which a container is given by name (the
    engine reads their values from its environment, never from its command line)."""
    environment = Environment(cwd=folder)
    code = spec.get("code") or {}
    if "git" in code:
        source = folder / "src"
        if not (source / ".git").exists():
            _run(
                ["git", "clone", "--quiet", "--no-checkout", str(code["git"]), str(source)], log, what="clone"
            )
        _run(
            [
                "git",
                "-c",
                "advice.detachedHead=false",
                "checkout",
                "--quiet",
                str(code.get("commit", "HEAD")),
            ],
            log,
            cwd=source,
            what="checkout",
        )
        environment.cwd = source
    elif "path" in code:
        path = Path(str(code["path"]))
        if not path.is_dir():
            log.write(f"klique: code path {path} is not a folder on this host\n".encode())
            raise BuildFailed(f"no folder {path}")
        environment.cwd = path

    requirements = [str(item) for item in spec.get("requirements", [])]
    if spec.get("requirements_file"):
        file = environment.cwd / str(spec["requirements_file"])
        if not file.is_file():
            log.write(f"klique: requirements file {file} does not exist\n".encode())
            raise BuildFailed(f"no file {file}")
        requirements += [
            line.strip()
            for line in file.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
    if requirements:
        key = hashlib.sha256("\n".join([sys.version, *sorted(requirements)]).encode()).hexdigest()[:16]
        venv = cache / key
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(venv)], log, what="virtual environment")
            _run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *requirements],
                log,
                what="pip install",
            )
            (venv / ".complete").touch()
        else:
            log.write(
                f"klique: reusing the environment {key} for {len(requirements)} requirements\n".encode()
            )
        environment.env = {
            "VIRTUAL_ENV": str(venv),
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    if spec.get("image"):
        environment.prefix = _container(spec["image"], environment.cwd, log, passed or {})
    return environment


def _container(image: object, workdir: Path, log: IO[bytes], passed: Mapping[str, str]) -> list[str]:
    """The container engine's command line that runs the task's command in `image` (agents.containers),
    after checking that the image can be had: BuildFailed names what is missing."""
    try:
        reference = images.engine_reference(image)
        pull = containers.pull_policy()
    except (images.ImageRefused, ValueError) as error:
        log.write(f"klique: {error}\n".encode())
        raise BuildFailed(str(error)) from None
    engine = containers.engine()
    if engine is None:
        log.write(b"klique: the task asks for a container image and no docker or podman engine runs here\n")
        raise BuildFailed("no container engine runs on this host")
    archives = os.environ.get("KLIQUE_IMAGE_ARCHIVES", "")
    present = containers.image_present(engine, reference)
    if not present and archives:
        archive = containers.archive_holding(Path(archives), reference)
        if archive is not None:
            try:
                _run([engine, "load", "--input", str(archive)], log, what="load")
            except BuildFailed:
                raise BuildFailed(f"the image {reference} could not be loaded from {archive}") from None
            present = containers.image_present(engine, reference)
    if not present:
        if pull == "never":
            where = f" nor in an archive in {archives}" if archives else ""
            log.write(
                f"klique: the image {reference} is not on this host{where}, and this agent does not pull "
                f"images (KLIQUE_IMAGE_PULL=never): load it there ({Path(engine).name} load -i ARCHIVE"
                f"{', or put the archive in ' + archives if archives else ''}) or build it there, or ask "
                "the host's administrator\n".encode()
            )
            raise BuildFailed(f"the image {reference} is not on this host")
        try:
            _run([engine, "pull", "--", reference], log, what="pull")
        except BuildFailed:
            raise BuildFailed(f"the image {reference} could not be pulled") from None
    task_id = os.environ.get("KLIQUE_TASK_ID", "")
    containers.remove(engine, task_id)  # an earlier run's, left by a crash
    argv, notes = containers.run_argv(
        engine,
        image=reference,
        task_id=task_id,
        workdir=workdir,
        passed=passed,
        runner_environment=os.environ,
    )
    for note in notes:
        log.write(f"{note}\n".encode())
    log.write(f"klique: container: {' '.join(argv)}\n".encode())
    log.flush()
    return argv
