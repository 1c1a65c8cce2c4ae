"""`klique submit | tasks | cancel | why | queues` through the SDK, as a user types them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from django_tenants.utils import schema_context

from apps.scheduling.cycle import run_cycle
from klique.cli import parse_args
from klique.commands import Progress, outcome_code, run
from klique.sdk import Client
from tests.django_transport import DjangoTransport
from tests.world import World


def klique(world: World, persona: str, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    client = Client("http://acme.klique.test", world.tokens[persona], transport=DjangoTransport())
    code = run(parse_args(argv), client)
    return code, capsys.readouterr().out


def test_submit_then_list_then_why(world: World, db: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = klique(
        world,
        "bob",
        "submit",
        "Research: shared GPU",
        "--gpus",
        "0.5",
        "--name",
        "notebook",
        "--",
        "python",
        "-c",
        "print(1)",
        capsys=capsys,
    )
    assert code == 0, out
    assert "to Research: shared GPU (1/2 GPUs): queued." in out
    task_id = out.split()[1]
    sdk = Client("http://acme.klique.test", world.tokens["bob"], transport=DjangoTransport())
    assert sdk.task(task_id)["spec"] == {"command": ["python", "-c", "print(1)"]}

    code, out = klique(world, "bob", "tasks", "--mine", capsys=capsys)
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["ID", "NAME", "STATE", "GPUS"]
    assert any(line.startswith(task_id[:8]) and "notebook" in line for line in lines)

    code, out = klique(world, "bob", "why", task_id[:8], capsys=capsys)
    assert code == 0
    assert "is queued in Research: shared GPU: position 1 (0 ahead)" in out

    with schema_context("acme"):
        run_cycle(world.tenant_a)
    code, out = klique(world, "bob", "why", task_id, capsys=capsys)
    assert f"Task {task_id} is placed in pool baremetal." in out


def test_queues_show_what_is_open(world: World, db: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = klique(world, "bob", "queues", capsys=capsys)
    assert code == 0
    rows = {line.split("  ")[0]: line for line in out.splitlines()[1:]}
    assert "yes" in rows["Research: 4 GPUs"]
    assert " no " in rows["Dev: 4 GPUs"]


def test_errors_are_the_server_s_sentences(
    world: World, db: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = klique(world, "bob", "submit", "Research: 4 GPUs", "--gpus", "64", capsys=capsys)
    assert code == 1
    assert out.startswith("klique submit: Research: 4 GPUs runs tasks of exactly 4 GPUs")
    code, out = klique(world, "dave", "cancel", world.task_a, capsys=capsys)
    assert code == 1
    assert "needs the member role" in out
    code, out = klique(world, "bob", "why", "ffff", capsys=capsys)
    assert "No task id starts with 'ffff'" in out
    code, out = klique(world, "bob", "cancel", world.task_a[:10], capsys=capsys)
    assert (code, out.split(":")[0]) == (0, f"Cancelled {world.task_a} (first)")


def test_a_missing_address_or_token_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KLIQUE_URL", raising=False)
    monkeypatch.delenv("KLIQUE_TOKEN", raising=False)
    code = run(parse_args(["queues"]))
    assert code == 1
    assert "Set KLIQUE_URL" in capsys.readouterr().out


def test_config_pull_edit_push_validate_provision(
    world: World, db: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = klique(world, "alice", "config", "pull", capsys=capsys)
    document = json.loads(out)
    document["pools"][0]["capacity_gpus"] = 12
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps(document))
    assert klique(world, "alice", "config", "push", str(draft), capsys=capsys)[0] == 0
    code, out = klique(world, "alice", "config", "validate", capsys=capsys)
    assert out.startswith("The draft is valid.")
    code, out = klique(world, "alice", "config", "provision", capsys=capsys)
    assert code == 0
    assert out.startswith("Provisioned.")
    shown = json.loads(klique(world, "dave", "config", "show", capsys=capsys)[1])
    assert shown["pools"][0]["capacity_gpus"] == 12

    draft.write_text("{not json")
    code, out = klique(world, "alice", "config", "push", str(draft), capsys=capsys)
    assert (code, "is not JSON" in out) == (1, True)
    code, out = klique(world, "bob", "config", "pull", capsys=capsys)
    assert (code, "needs the admin role" in out) == (1, True)


def test_submit_json_with_a_key_and_outputs_for_scripts(
    world: World, db: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ("submit", "Research: 4 GPUs", "--json", "--idempotency-key", "ci-77", "--output", "*.pt",
            "--output", "logs/*.txt", "--", "python", "train.py")  # fmt: skip
    code, out = klique(world, "bob", *argv, capsys=capsys)
    assert code == 0, out
    task = json.loads(out)  # stdout is the task, as JSON, and nothing else
    assert task["spec"] == {"command": ["python", "train.py"], "outputs": ["*.pt", "logs/*.txt"]}
    code, out = klique(world, "bob", *argv, capsys=capsys)
    assert json.loads(out)["id"] == task["id"]  # a retried CI job gets the task it made


@pytest.mark.parametrize(
    ("given", "seconds"), [("90s", 90), ("45m", 2700), ("2h", 7200), ("1d", 86_400), ("600", 600)]
)
def test_a_time_limit_is_given_as_a_duration(
    world: World, db: None, capsys: pytest.CaptureFixture[str], given: str, seconds: int
) -> None:
    code, out = klique(
        world, "bob", "submit", "Research: 4 GPUs", "--json", "--time-limit", given, capsys=capsys
    )
    assert code == 0, out
    assert json.loads(out)["time_limit_seconds"] == seconds


@pytest.mark.parametrize("given", ["2x", "h", "0", "0m", "1.5h", ""])
def test_a_time_limit_that_is_not_a_duration_is_refused_before_anything_is_sent(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(("submit", "Research: 4 GPUs", "--time-limit", given))
    assert "is not a duration" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("state", "exit_code", "outcome"),
    [("completed", 0, 0), ("failed", 3, 3), ("failed", None, 1), ("failed", 0, 1), ("failed", 300, 1),
     ("failed", -9, 1), ("aborted", None, 3)],
)  # fmt: skip
def test_the_exit_code_of_a_wait_is_the_tasks_outcome(
    state: str, exit_code: int | None, outcome: int
) -> None:
    assert outcome_code({"state": state, "exit_code": exit_code}) == outcome


def test_a_wait_says_what_the_task_is_doing_when_it_changes() -> None:
    said = io.StringIO()
    progress = Progress("t1", said)
    queued = {"state": "queued", "reason": "Waiting for 4 GPUs in pool lab.", "pool": None}
    progress.saw(queued)
    progress.saw(queued)  # the same again: not said again (not a terminal)
    progress.saw({"state": "running", "reason": "", "pool": "lab"})
    lines = said.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[klique] task t1 queued (")
    assert lines[0].endswith("Waiting for 4 GPUs in pool lab.")
    assert lines[1].startswith("[klique] task t1 running on pool lab (")
