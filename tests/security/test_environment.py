"""Environment that could reach a privileged process: one rule for the names a task may set (its spec's
environment and the secrets it is given), checked when a secret is kept, when a task is submitted and by
the agent; the agent's own programs never run in an environment a user influenced."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from agents.backend import Refused
from agents.baremetal import BareMetal
from agents.hpc import SYSTEM_PATH, Batch, Completed, Settings, Slurm, agent_environment, execute
from agents.state import Position, State
from apps.accounts.models import User
from apps.vault.models import Secret
from protocol import environment as rule
from protocol.units import UNITS_PER_GPU
from tests.world import World

# Loader, shell, interpreter, identity and placement variables, in several spellings.
REFUSED = [
    "PATH", "path", "Path", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "ld_preload",
    "DYLD_INSERT_LIBRARIES",
    "GCONV_PATH", "GLIBC_TUNABLES", "MALLOC_CHECK_", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME",
    "PYTHONINSPECT", "BASH_ENV", "ENV", "IFS", "BASH_FUNC_ls", "SHELLOPTS", "PS4", "PROMPT_COMMAND",
    "PERL5OPT", "PERL5LIB", "RUBYOPT", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS", "HOME", "USER", "SHELL",
    "LOGNAME", "SBATCH_ACCOUNT", "SBATCH_EXPORT", "SLURM_CONF", "SRUN_EXPORT_ENV", "PBS_O_HOME",
    "LSB_JOB_ENV", "KLIQUE_TASK_ID", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "APPTAINERENV_X",
    "SINGULARITYENV_LD_PRELOAD", "OPENSSL_CONF", "HOSTALIASES",
]  # fmt: skip
MALFORMED = ["1ABC", "A-B", "A B", "A=B", "", "X" * 129, "NAME\x00", "É"]
ALLOWED = ["HF_TOKEN", "WANDB_API_KEY", "EPOCHS", "my_setting", "PATHOLOGY", "HOMEWORK", "TMPDIR", "_X"]


@pytest.mark.parametrize("name", REFUSED)
def test_loader_shell_identity_and_placement_variables_are_refused_with_why(name: str) -> None:
    why = rule.refusal(name)
    assert why is not None
    assert why.startswith(f"{name} cannot be set by a task: ")
    with pytest.raises(rule.NameRefused, match="cannot be set by a task"):
        rule.checked({name: "x"})


@pytest.mark.parametrize("name", MALFORMED)
def test_names_outside_the_allow_pattern_are_refused(name: str) -> None:
    why = rule.refusal(name)
    assert why is not None
    assert "not an environment variable name" in why


@pytest.mark.parametrize("name", ALLOWED)
def test_ordinary_names_pass(name: str) -> None:
    assert rule.refusal(name) is None
    assert rule.checked({name: 3}) == {name: "3"}


@pytest.mark.parametrize("value", [True, None, ["a"], {"a": 1}, "nul\x00inside", "x" * (64 * 1024 + 1)])
def test_values_that_no_environment_holds_are_refused(value: object) -> None:
    with pytest.raises(rule.NameRefused, match="The value of DATA"):
        rule.checked({"DATA": value})


# The three places the rule is checked ------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "HOME", "BASH_ENV", "A-B"])
def test_a_secret_cannot_be_kept_under_such_a_name(
    name: str, api: Callable[..., APIClient], world: World
) -> None:
    answer = api("bob").post("/api/v1/secrets/", {"name": name, "value": "/home/evil"}, format="json")
    assert answer.status_code == 400, answer.content
    assert "A secret cannot be named so." in answer.json()["detail"]
    with schema_context("acme"):
        assert not Secret.objects.filter(name=name).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["PATH", "LD_PRELOAD", "PYTHONSTARTUP", "USER", "LOGNAME", "SBATCH_ACCOUNT"])
def test_a_task_cannot_be_submitted_with_such_a_variable(
    name: str, api: Callable[..., APIClient], world: World
) -> None:
    spec = {"command": ["true"], "environment": {"EPOCHS": "3", name: "/home/evil"}}
    answer = api("bob").post(
        "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "spec": spec}, format="json"
    )
    assert answer.status_code == 400, answer.content
    assert f"{name} cannot be set by a task" in answer.json()["detail"]


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["PATH", "LD_PRELOAD", "HOME"])
def test_a_secret_kept_under_such_a_name_before_the_rule_cannot_be_given_to_a_task(
    name: str, api: Callable[..., APIClient], world: World
) -> None:
    with schema_context("acme"):  # as an older Klique could have kept it
        bob = User.objects.get(username="bob")
        Secret.objects.create(scope="user", owner=bob, name=name, ciphertext=b"x", created_by=bob)
    spec = {"command": ["true"], "secrets": [name]}
    answer = api("bob").post(
        "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "spec": spec}, format="json"
    )
    assert answer.status_code == 400, answer.content
    assert f"cannot be given secret {name}" in answer.json()["detail"]


def _bare_assignment(command: list[str], **extra: Any) -> dict[str, Any]:
    spec = {"command": command, **extra.pop("spec", {})}
    return {"task_id": "t-env", "lease_id": "l", "size_units": UNITS_PER_GPU, "spec": spec, **extra}


@pytest.mark.parametrize(
    "given",
    [
        {"secrets": {"PATH": "/home/evil"}},
        {"secrets": {"LD_PRELOAD": "/home/evil.so"}},
        {"secrets": {"HOME": "/home/evil"}},
        {"spec": {"environment": {"PYTHONPATH": "/home/evil"}}},
        {"spec": {"environment": {"BASH_ENV": "/home/evil.sh"}}},
        {"spec": {"environment": {"bad name": "1"}}},
    ],
)
def test_the_bare_metal_agent_refuses_what_the_plane_should_have(
    given: dict[str, Any], tmp_path: Path
) -> None:
    bare = BareMetal(1, tmp_path / "work", State(tmp_path / "agent.sqlite"))

    async def report(task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        raise AssertionError("nothing starts")

    with pytest.raises(Refused, match=r"cannot be set by a task|not an environment variable name") as refused:
        asyncio.run(bare.start(_bare_assignment(["true"], **given), report))
    assert refused.value.permanent
    assert bare.running() == []


def test_on_bare_metal_only_the_tasks_command_has_its_variables(tmp_path: Path) -> None:
    """The runner (the agent's own program, forked by agents.zygote) is started without the task's
    variables; they reach the command through a pipe, in memory. /proc shows each process's environment
    as it started."""
    bare = BareMetal(1, tmp_path / "work", State(tmp_path / "agent.sqlite"))
    marker = tmp_path / "started"
    script = (
        "import os, pathlib, sys, time;"
        "print(os.environ['HF_TOKEN'], os.environ['EPOCHS'], os.environ['KLIQUE_TASK_ID']);"
        f"pathlib.Path({str(marker)!r}).write_text(str(os.getppid())); time.sleep(30)"
    )
    given = _bare_assignment(
        [sys.executable, "-c", script], spec={"environment": {"EPOCHS": "3"}}, secrets={"HF_TOKEN": "hf_abc"}
    )
    seen: list[tuple[str, dict[str, Any]]] = []

    async def report(task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        seen.append((kind, body))

    async def scenario() -> tuple[bytes, bytes]:
        await bare.start(given, report)
        for _ in range(200):
            if marker.exists() and marker.read_text():
                break
            await asyncio.sleep(0.05)
        runner = Path(f"/proc/{marker.read_text()}")
        seen = (runner / "cmdline").read_bytes(), (runner / "environ").read_bytes()
        await bare.stop("t-env", 0)
        return seen

    runner_command, runner_environment = asyncio.run(scenario())
    assert b"agents.zygote" in runner_command  # it is the runner: a fork of the zygote
    assert b"hf_abc" not in runner_environment
    assert b"EPOCHS=" not in runner_environment
    output = (tmp_path / "work" / "t-env" / "output.log").read_text()
    assert "hf_abc 3 t-env" in output  # the command has its variables and Klique's


class Recorded:
    """A cluster that records what each command was run with."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict[str, str], str | None]] = []

    async def __call__(
        self,
        argv: Sequence[str],
        stdin: bytes | None,
        environment: Mapping[str, str] | None,
        account: str | None = None,
        output: BinaryIO | None = None,
        /,
    ) -> Completed:
        self.calls.append((list(argv), dict(environment or {}), account))
        answer = Completed(0, "4242\n", "") if argv[0] == "sbatch" else Completed(0, "", "")
        if output is not None:
            output.write(answer.stdout.encode())
        return answer


def _slurm(tmp_path: Path, cluster: Recorded) -> Batch:
    import pwd

    me = pwd.getpwuid(os.geteuid()).pw_name
    settings = Settings(jobs_dir=tmp_path / "jobs", user_map={"alice": me}, poll_seconds=3600)
    return Batch(Slurm(), settings, State(tmp_path / "agent.sqlite"), "https://acme.example", run=cluster)


def _hpc_assignment(**extra: Any) -> dict[str, Any]:
    return {
        "task_id": "6f1c9a0e-0000-4000-8000-00000000e1e1",
        "lease_id": "l",
        "size_units": UNITS_PER_GPU,
        "nodes": 1,
        "user": "alice",
        "task_token": "kqt_x_y",
        "spec": {"command": ["true"], **extra.pop("spec", {})},
        **extra,
    }


@pytest.mark.parametrize("name", ["PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "HOME", "USER", "LOGNAME"])
def test_the_hpc_agent_refuses_such_a_secret_instead_of_failing(name: str, tmp_path: Path) -> None:
    cluster = Recorded()
    batch = _slurm(tmp_path, cluster)

    async def report(task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        pass

    async def scenario() -> None:
        try:
            await batch.start(_hpc_assignment(secrets={name: "/home/evil"}), report)
        finally:
            if batch.poller is not None:
                batch.poller.cancel()

    with pytest.raises(Refused, match=f"{name} cannot be set by a task") as refused:
        asyncio.run(scenario())
    assert refused.value.permanent
    assert [argv for argv, _, _ in cluster.calls if argv[0] == "sbatch"] == []


def test_the_submission_runs_as_the_account_with_a_fixed_path_and_no_privileged_helper(
    tmp_path: Path,
) -> None:
    cluster = Recorded()
    batch = _slurm(tmp_path, cluster)

    async def report(task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        pass

    async def scenario() -> None:
        await batch.start(_hpc_assignment(secrets={"HF_TOKEN": "hf_abc"}), report)
        assert batch.poller is not None
        batch.poller.cancel()

    asyncio.run(scenario())
    [(argv, environment, account)] = [call for call in cluster.calls if call[0][0] == "sbatch"]
    assert not {"runuser", "sudo", "su"} & set(argv)
    assert account == batch.account_for("alice")
    assert environment["PATH"] == SYSTEM_PATH
    assert environment["HF_TOKEN"] == "hf_abc"  # sbatch passes it on to the job; nothing else sees it
    set_by_the_agent = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", *agent_environment()}
    assert not {name for name in environment if rule.refusal(name)} - set_by_the_agent
    assert "hf_abc" not in " ".join(argv)


def test_cluster_commands_are_run_by_absolute_path_from_the_agents_folders(tmp_path: Path) -> None:
    """A program of the same name earlier in a PATH that someone else controls is never run: the agent
    looks commands up in its own folders only and hands the child an environment it built."""
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "id").write_text("#!/bin/sh\necho evil\n")
    (evil / "id").chmod(0o755)
    os.environ["PATH"] = f"{evil}:{os.environ['PATH']}"
    try:
        done = asyncio.run(execute(["id", "-u"]))
    finally:
        os.environ["PATH"] = os.environ["PATH"].split(":", 1)[1]
    assert done.returncode == 0
    assert done.stdout.strip() == str(os.geteuid())
    missing = asyncio.run(execute(["no-such-command-here"]))
    assert missing.returncode == 127
    assert "command not found" in missing.message
