"""Batch templates: sandboxed, checked when saved, and no task value reaches a shell unquoted."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agents.hpc import Settings
from protocol.batch import (
    DEFAULT_TEMPLATES,
    SCHEDULERS,
    TemplateInvalid,
    Unsafe,
    check_template,
    render,
    sample_context,
)
from protocol.scripts import Scripts

TASK = "0b5f3a52-6b1e-4a39-9a8e-1d0c2f6f7e10"


def scripts(scheduler: str, tmp_path: Path, **settings: Any) -> Scripts:
    return Scripts(
        scheduler,
        Settings(
            jobs_dir=tmp_path / "jobs", node_python="/usr/bin/python3", allowed_roots=[tmp_path], **settings
        ),
        "https://acme.klique.example",
    )


def assignment(**overrides: Any) -> dict[str, Any]:
    return {
        "task_id": TASK,
        "name": "train",
        "size_units": 2 * 840,
        "nodes": 1,
        "spec": {"command": ["python", "train.py", "--epochs", "3"]},
        **overrides,
    }


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_the_default_templates_pass_their_own_checks_and_place_the_size(
    scheduler: str, tmp_path: Path
) -> None:
    check_template(DEFAULT_TEMPLATES[scheduler], scheduler)
    script, context = scripts(scheduler, tmp_path).script(
        assignment(size_units=8 * 840, nodes=2), "alice", tmp_path / "jobs" / TASK
    )
    assert script.startswith("#!/bin/bash\n")
    assert (context["nodes"], context["gpus_per_node"], context["gpus"]) == (2, 4, 8)
    size_line = {
        "slurm": "#SBATCH --gpus-per-node=4",
        "pbs": "#PBS -l nodes=2:gpus=4",
        "lsf": '#BSUB -gpu "num=4:mode=exclusive_process"',
    }[scheduler]
    assert size_line in script.splitlines()
    run_line = script.rstrip("\n").splitlines()[-1]
    assert "python train.py --epochs 3" in run_line
    assert "--token-file" in run_line


def test_the_slurm_script_is_what_bash_and_sbatch_would_read(tmp_path: Path) -> None:
    spec = {
        "command": ["python", "-c", "print('hi')"],
        "environment": {"GREETING": "hello world", "RATE": "0.5"},
        "batch": {"partition": "gpu", "account": "research", "time_limit_minutes": 90},
    }
    script, _ = scripts("slurm", tmp_path).script(assignment(spec=spec), "alice", tmp_path / "jobs" / TASK)
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        f"#SBATCH --job-name=klique-{TASK[:8]}-train",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=2",
        f"#SBATCH --output={tmp_path}/jobs/{TASK}/output.log",
        f"#SBATCH --chdir={tmp_path}/jobs/{TASK}",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=research",
        "#SBATCH --time=90",
    ]
    assert "export GREETING='hello world'" in script.splitlines()
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # it parses as a shell script


PWNED = "/tmp/klique-pwned"  # noqa: S108 -- what the hostile values would create; never created
INJECTIONS = [f"$(touch {PWNED})", f"`touch {PWNED}`", "a'b\"c", "; rm -rf ~", "x && id"]


@pytest.mark.parametrize("value", INJECTIONS)
def test_arguments_and_environment_values_are_data(value: str, tmp_path: Path) -> None:
    spec = {"command": ["echo", value], "environment": {"VALUE": value}}
    script, _ = scripts("slurm", tmp_path).script(
        assignment(spec=spec, name=value), "alice", tmp_path / "jobs" / TASK
    )
    run_line = script.rstrip("\n").splitlines()[-1]
    assert shlex.split(run_line)[-2:] == ["echo", value]  # one word each, exactly as given
    assert f"export VALUE={shlex.quote(value)}" in script.splitlines()
    # The job name keeps only safe characters of the task's name.
    name_line = next(line for line in script.splitlines() if line.startswith("#SBATCH --job-name="))
    assert set(name_line.removeprefix("#SBATCH --job-name=")) <= set(
        "abcdefghijklmnopqrstuvwxyz0123456789-._"
    )
    # The exports and the run line, run by bash, print the values and create nothing.
    marker = tmp_path / "pwned"
    body = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    probe = subprocess.run(
        ["bash", "-c", f"{body}\nprintf '%s' \"$VALUE\""],
        text=True,
        capture_output=True,
        check=True,
        cwd=tmp_path,
    )
    assert probe.stdout == value
    assert not marker.exists()
    assert not Path(PWNED).exists()


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ({"command": ["echo", "ok\n#SBATCH --uid=0"]}, "newline"),
        ({"command": ["echo"], "environment": {"X": "1\n#SBATCH --uid=0"}}, "newline"),
        (
            {"command": ["echo"], "batch": {"partition": "gpu\n#SBATCH --uid=0"}},
            "cannot go into a batch script",
        ),
        ({"command": ["echo"], "batch": {"partition": "$(id)"}}, "cannot go into a batch script"),
        ({"command": ["echo"], "batch": {"account": "-A root"}}, "cannot go into a batch script"),
        ({"command": ["echo"], "batch": {"directives": {"--uid": "0"}}}, "not allowed"),
        ({"command": ["echo"], "batch": {"time_limit_minutes": "60; id"}}, "whole number"),
        ({"command": ["echo"], "batch": {"nodes": 3}}, "Unknown batch settings"),
        ({"command": ["echo"], "environment": {"LD_PRELOAD": "evil.so"}}, "cannot be set by a task"),
        ({"command": ["echo"], "environment": {"BAD NAME": "1"}}, "not an environment variable"),
        ({"command": ["echo"], "code": {"path": "/etc"}}, "outside the folders"),
        ({"command": ["echo"], "image": "/etc/shadow.sif"}, "outside the folders"),
        ({"command": ["echo"], "image": "docker://x$(id)"}, "cannot go into a batch script"),
        ({"command": "echo hi"}, "no command"),
    ],
)
def test_values_that_cannot_be_data_are_refused_with_a_reason(
    spec: dict[str, Any], names: str, tmp_path: Path
) -> None:
    with pytest.raises(Unsafe, match=names):
        scripts("slurm", tmp_path).script(assignment(spec=spec), "alice", tmp_path / "jobs" / TASK)


def test_directives_a_template_allows_are_checked_and_rendered(tmp_path: Path) -> None:
    batch = {"slurm": {"allowed_directives": ["--qos", "--constraint"]}}
    spec = {"command": ["true"], "batch": {"directives": {"--qos": "high", "--constraint": "a100"}}}
    script, _ = scripts("slurm", tmp_path).script(
        assignment(spec=spec, batch=batch), "alice", tmp_path / "jobs" / TASK
    )
    assert "#SBATCH --constraint=a100" in script.splitlines()
    assert "#SBATCH --qos=high" in script.splitlines()


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("#!/bin/bash\n{{ nodes }} {{ gpus_per_node }} {% if %}\n{{ run }}", "line 2"),
        ("#!/bin/bash\n#SBATCH --nodes={{ nodes }}\n{{ run }}\n", "gpus_per_node"),
        ("#!/bin/bash\n#SBATCH --gpus={{ gpus }}\n", "nodes, run"),
        ("#SBATCH --nodes={{ nodes }} --gpus={{ gpus }}\n{{ run }}", "must start with #!"),
        ("#!/bin/bash\n{{ nodes }}{{ gpus }}{{ run }}{{ no_such_value }}", "undefined"),
        (
            "#!/bin/bash\n{{ nodes }}{{ gpus }}{{ run }}{{ run.__class__.__mro__ }}",
            "sandbox|unsafe|undefined",
        ),
        ("#!/bin/bash\n{{ nodes }}{{ gpus }}{{ run }}{{ [1, 2] }}", "single values"),
    ],
)
def test_a_template_that_is_not_usable_is_refused_when_saved(template: str, message: str) -> None:
    with pytest.raises((TemplateInvalid, Unsafe), match=message):
        check_template(template, "slurm")


@pytest.mark.parametrize("option", ["--uid", "--output", "-A", "--gres", "--export", "qos", "--qos; id"])
def test_a_template_cannot_leave_identity_size_or_output_to_tasks(option: str) -> None:
    with pytest.raises(TemplateInvalid):
        check_template(DEFAULT_TEMPLATES["slurm"], "slurm", [option])


def test_a_template_cannot_print_an_unsafe_value_it_computes() -> None:
    context = {**sample_context("slurm"), "partition": "gpu; touch /tmp/x"}
    with pytest.raises(Unsafe, match=r"partition|A value"):
        render(DEFAULT_TEMPLATES["slurm"], context)


def test_fractions_of_a_gpu_are_refused_on_batch_pools(tmp_path: Path) -> None:
    with pytest.raises(Unsafe, match="whole GPUs"):
        scripts("slurm", tmp_path).script(assignment(size_units=420), "alice", tmp_path / "jobs" / TASK)


def test_containers_run_through_apptainer_or_pyxis(tmp_path: Path) -> None:
    spec = {"command": ["python", "x.py"], "image": "docker://nvcr.io/nvidia/pytorch:24.05-py3"}
    apptainer, _ = scripts("slurm", tmp_path).script(assignment(spec=spec), "alice", tmp_path / "jobs" / TASK)
    assert "-- apptainer exec --nv docker://nvcr.io/nvidia/pytorch:24.05-py3 python x.py" in apptainer
    pyxis, _ = scripts("slurm", tmp_path, container_runtime="pyxis").script(
        assignment(spec=spec), "alice", tmp_path / "jobs" / TASK
    )
    assert "--container-image=docker://nvcr.io/nvidia/pytorch:24.05-py3 python x.py" in pyxis
    local = tmp_path / "images" / "train.sif"
    spec = {"command": ["python", "x.py"], "image": str(local)}
    pbs, _ = scripts("pbs", tmp_path).script(assignment(spec=spec), "alice", tmp_path / "jobs" / TASK)
    assert f"-- apptainer exec --nv {local} python x.py" in pbs


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_an_apps_node_reporter_picks_its_port_and_opens_its_relay(scheduler: str, tmp_path: Path) -> None:
    folder = tmp_path / "jobs" / TASK
    app = {"instance": "0123abcd", "port": None, "health_path": "/", "startup_seconds": 60}
    spec = {"command": ["jupyter", "lab", "--port={port}"], "app": app}
    script, _ = scripts(scheduler, tmp_path).script(assignment(spec=spec), "alice", folder)
    options = f"--app-port auto --app-key-file {folder}/app-key -- jupyter lab '--port={{port}}'"
    assert options in script  # {port} is the node's to fill in, as a word the shell leaves alone
    fixed, _ = scripts(scheduler, tmp_path).script(
        assignment(spec={**spec, "app": {**app, "port": 8888}}), "alice", folder
    )
    assert "--app-port 8888 --app-key-file" in fixed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"nodes": 2}, "An app runs on one node; this one asks for 2"),
        ({"app": {"port": 80}}, "The app's port is not a port from 1024 to 65535"),
        ({"app": {"port": "8888; id"}}, "The app's port is not a port from 1024 to 65535"),
        ({"app": {"port": True}}, "The app's port is not a port from 1024 to 65535"),
    ],
)
def test_an_app_that_cannot_run_in_a_job_is_refused(
    overrides: dict[str, Any], message: str, tmp_path: Path
) -> None:
    spec = {"command": ["serve"], "app": overrides.get("app", {"port": None})}
    task = assignment(spec=spec, nodes=overrides.get("nodes", 1))
    with pytest.raises(Unsafe, match=message):
        scripts("slurm", tmp_path).script(task, "alice", tmp_path / "jobs" / TASK)
