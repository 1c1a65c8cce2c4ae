"""The CI examples (examples/ci/) run for real against `klique up --demo`: a small runner executes the
GitHub Actions workflow's and the GitLab CI job's own commands, as those runners would (the job's
environment with its variables and secrets, each step in bash with errexit and pipefail, `if:` on a
failure), with this checkout's `klique` CLI on the PATH in place of the install step. A task that exits 0
passes the job and its outputs are kept; one that exits 3 fails the job with exit code 3; the task's
output is in the job's log; a re-run of the same attempt finds its task instead of queueing another."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import ROOT, Running, clean_environment, start_up
from tests.e2e.test_agent_crash import Demo
from tests.e2e.test_up import BANNER_CURL

pytestmark = pytest.mark.e2e

EXAMPLES = ROOT / "examples" / "ci"
EXPRESSION = re.compile(r"\$\{\{\s*(vars|secrets)\.([A-Z_]+)\s*\}\}")
PASSES = "python3 -c open('model.pt','w').write('weights');print('trained:',6*7)"  # split on spaces
FAILS = "python3 -c print('diverged');exit(3)"


@dataclass
class Job:
    code: int
    log: str
    folder: Path

    def task(self) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads((self.folder / "task.json").read_text())
        return answer


def _bash(script: str, environment: dict[str, str], folder: Path) -> tuple[int, str]:
    done = subprocess.run(
        ["/bin/bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def _path() -> str:
    return f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"


def github(folder: Path, values: dict[str, str], *, run_id: str, attempt: str = "1") -> Job:
    """The workflow's job as GitHub's runner runs it: its env (vars and secrets filled in), its `run`
    steps in order, a step after a failure only with `if: always()` or `failure()`."""
    workflow = yaml.safe_load((EXAMPLES / "github-actions.yml").read_text())
    (job,) = workflow["jobs"].values()

    def filled(text: str) -> str:
        text = EXPRESSION.sub(lambda match: values[match.group(2)], text)
        assert "${{" not in text, f"an expression this runner does not know: {text}"
        return text

    folder.mkdir(parents=True, exist_ok=True)
    summary = folder / "summary.md"
    environment = {
        "PATH": _path(), "HOME": str(folder), "GITHUB_REPOSITORY": "acme/vision", "GITHUB_RUN_ID": run_id,
        "GITHUB_RUN_ATTEMPT": attempt, "GITHUB_STEP_SUMMARY": str(summary),
        **{name: filled(str(value)) for name, value in job["env"].items()},
    }  # fmt: skip
    failed, log, code = False, [], 0
    for step in job["steps"]:
        if "uses" in step or step["name"].startswith("Install"):
            continue  # actions/setup-python, and the install: this checkout's CLI is on the PATH
        condition = step.get("if", "success()")
        if failed and "always()" not in condition and "failure()" not in condition:
            continue
        if not failed and condition == "failure()":
            continue
        step_code, said = _bash(filled(step["run"]), environment, folder)
        log.append(f"## {step['name']} (exit {step_code})\n{said}")
        if step_code and not failed:
            failed, code = True, step_code
    if summary.exists():
        log.append(summary.read_text())
    return Job(code, "\n".join(log), folder)


def gitlab(folder: Path, values: dict[str, str], *, job_id: str) -> Job:
    """The job as GitLab's runner runs it: its variables and the project's CI/CD variables, its script
    lines in order in one shell, stopping at the first that fails."""
    pipeline = yaml.safe_load((EXAMPLES / "gitlab-ci.yml").read_text())
    job = pipeline["train-on-klique"]
    folder.mkdir(parents=True, exist_ok=True)
    environment = {
        "PATH": _path(), "HOME": str(folder), "CI_PROJECT_PATH": "acme/vision", "CI_PROJECT_ID": "7",
        "CI_PIPELINE_ID": "100", "CI_JOB_ID": job_id, **job["variables"], **values,
    }  # fmt: skip
    code, said = _bash("\n".join(job["script"]), environment, folder)  # before_script: the install
    return Job(code, said, folder)


@pytest.fixture
def plane(fresh_database: str, redis_url: str, tmp_path: Path) -> Iterator[tuple[Demo, str]]:
    """`klique up --demo`, and a CI service account's token of scope submit."""
    running: Running = start_up(
        clean_environment(DATABASE_URL=fresh_database, REDIS_URL=redis_url), tmp_path / "data"
    )
    try:
        demo = Demo(running.port, running.wait_for(BANNER_CURL)[1])
        account = demo.call("POST", "/api/v1/service-accounts/", json={"name": "ci", "role": "member"})
        demo.call(
            "PATCH", f"/api/v1/groups/{_research(demo)}/", json={"members": [*_members(demo), account["id"]]}
        )
        token = demo.call(
            "POST",
            f"/api/v1/service-accounts/{account['id']}/tokens/",
            json={"name": "ci", "scope": "submit"},
        )["token"]
        deadline = time.monotonic() + 90
        while demo.call("GET", "/api/v1/tasks/?state=completed")["count"] < 2:  # the demo's own tasks ran
            assert time.monotonic() < deadline, demo.call("GET", "/api/v1/tasks/")
            time.sleep(0.5)
        yield demo, token
    finally:
        assert running.interrupt() == 0


def _research(demo: Demo) -> str:
    return str(
        next(g["id"] for g in demo.call("GET", "/api/v1/groups/")["results"] if g["name"] == "research")
    )


def _members(demo: Demo) -> list[str]:
    group = demo.call("GET", f"/api/v1/groups/{_research(demo)}/")
    return [str(member) for member in group["members"]]


def test_the_ci_examples_pass_for_a_task_that_succeeds_and_fail_for_one_that_fails(
    plane: tuple[Demo, str], tmp_path: Path
) -> None:
    demo, token = plane
    values = {
        "KLIQUE_URL": f"http://demo.localhost:{demo.port}",
        "KLIQUE_TOKEN": token,
        "KLIQUE_COMPUTE_RESOURCE": "Research: 4 GPUs",
    }

    passed = github(tmp_path / "gh-pass", {**values, "KLIQUE_COMMAND": PASSES}, run_id="501")
    assert passed.code == 0, passed.log
    assert "trained: 42" in passed.log  # the task's output, in the job's log
    assert passed.task()["state"] == "completed"
    assert passed.task()["submitter"] == "ci"
    assert "Klique task" in passed.log  # the summary step ran
    assert (passed.folder / "outputs" / "model.pt").read_text() == "weights"  # the task's output, kept

    again = github(tmp_path / "gh-rerun", {**values, "KLIQUE_COMMAND": PASSES}, run_id="501")
    assert again.code == 0, again.log
    assert again.task()["id"] == passed.task()["id"]  # the same attempt again: the same task

    failed = github(tmp_path / "gh-fail", {**values, "KLIQUE_COMMAND": FAILS}, run_id="502")
    assert failed.code == 3, failed.log  # the task's own exit code fails the job
    assert "diverged" in failed.log
    assert (failed.task()["state"], failed.task()["exit_code"]) == ("failed", 3)
    assert "## Keep the task's outputs" not in failed.log  # `if: success()` after a failure: skipped
    assert "## Say how the task ended (exit 0)" in failed.log  # `if: always()`: ran

    lab = gitlab(tmp_path / "gl-pass", {**values, "KLIQUE_COMMAND": PASSES}, job_id="9001")
    assert lab.code == 0, lab.log
    assert "trained: 42" in lab.log
    assert lab.task()["state"] == "completed"
    broken = gitlab(tmp_path / "gl-fail", {**values, "KLIQUE_COMMAND": FAILS}, job_id="9002")
    assert broken.code == 3, broken.log
    assert broken.task()["state"] == "failed"
    assert not (broken.folder / "outputs").exists()  # the job stopped at the failing line

    # A job that stops waiting (its timeout) cancels its task: no GPU is left busy for nobody.
    waited = subprocess.run(
        ["klique", "submit", "Research: 4 GPUs", "--wait", "--timeout", "4", "--json", "--",
         "python3", "-c", "import time; print('started', flush=True); time.sleep(120)"],
        env={"PATH": _path(), "KLIQUE_URL": values["KLIQUE_URL"], "KLIQUE_TOKEN": token},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert waited.returncode == 124, waited.stdout + waited.stderr
    gave_up = json.loads(waited.stdout)
    assert gave_up["state"] == "aborted"
    assert "Gave up after" in waited.stderr
