"""Rebuilding a task's environment: code from git at a commit, cached virtual environments, containers,
and a clear failure with the build log when it cannot be built."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from agents.environment import BUILD_FAILED
from protocol.units import UNITS_PER_GPU
from tests.agents.test_baremetal import Recorder, backend


def run_task(tmp_path: Path, spec: dict[str, Any]) -> Recorder:
    bare = backend(tmp_path)

    async def scenario() -> Recorder:
        recorder = Recorder(bare.state)
        await bare.start(
            {"task_id": "t", "lease_id": "l", "size_units": UNITS_PER_GPU, "spec": spec}, recorder
        )
        await asyncio.wait_for(recorder.finished.wait(), timeout=120)
        return recorder

    return asyncio.run(scenario())


def git(*arguments: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *arguments],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def test_code_comes_from_git_at_the_commit_asked_for(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    repository.mkdir()
    git("init", "--quiet", cwd=repository)
    (repository / "train.py").write_text("print('version one')\n")
    git("add", ".", cwd=repository)
    git("commit", "--quiet", "-m", "one", cwd=repository)
    first = git("rev-parse", "HEAD", cwd=repository)
    (repository / "train.py").write_text("print('version two')\n")
    git("commit", "--quiet", "-am", "two", cwd=repository)

    recorder = run_task(
        tmp_path,
        {"command": [sys.executable, "train.py"], "code": {"git": str(repository), "commit": first}},
    )
    assert "version one" in recorder.lines()
    assert recorder.reports[-1][1]["exit_code"] == 0


def tiny_wheel(folder: Path) -> Path:
    """A one-module wheel written by hand (a wheel is a zip with its metadata): no build tool needed."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "tinypkg-1.0-py3-none-any.whl"
    info = "tinypkg-1.0.dist-info"
    files = {
        "tinypkg/__init__.py": "GREETING = 'hello from tinypkg'\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return wheel


def test_requirements_go_into_a_cached_virtual_environment(tmp_path: Path) -> None:
    wheel = tiny_wheel(tmp_path / "wheels")
    spec = {
        "command": ["python", "-c", "import tinypkg; print(tinypkg.GREETING)"],
        "requirements": [str(wheel)],
    }
    first = run_task(tmp_path, spec)
    assert "hello from tinypkg" in first.lines(), first.lines()
    second = run_task(tmp_path / "again", spec | {})  # another agent folder: a fresh cache
    assert "hello from tinypkg" in second.lines()
    reused = run_task(tmp_path, spec)  # the same agent: the cached environment serves again
    assert any("reusing the environment" in line for line in reused.lines())


def test_an_environment_that_cannot_be_built_fails_with_its_build_log(tmp_path: Path) -> None:
    recorder = run_task(
        tmp_path, {"command": ["python", "-c", "print(1)"], "code": {"git": str(tmp_path / "no-such-repo")}}
    )
    assert recorder.reports[-1][1]["exit_code"] == BUILD_FAILED
    lines = recorder.lines()
    assert any(line.startswith("klique: clone: git clone") for line in lines)
    assert any("could not be built (clone failed" in line for line in lines)


def test_a_container_image_needs_an_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KLIQUE_CONTAINER_ENGINE", "no-such-engine")  # the runner inherits the agent's
    recorder = run_task(tmp_path, {"command": ["true"], "image": "python:3.11"})
    assert recorder.reports[-1][1]["exit_code"] == BUILD_FAILED
    assert "no container engine runs on this host" in recorder.reports[-1][1]["reason"]
    assert any("no docker or podman engine runs here" in line for line in recorder.lines())
