"""[agent.cloud] is checked whole, each problem named; the user data an instance boots with quotes every
value and keeps the token off every command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agents.cloud.bootstrap import user_data
from agents.cloud.settings import Bootstrap, CloudSettings


def config(**cloud: Any) -> dict[str, Any]:
    section = {"region": "us-east-1", "image": "ami-1", "instance_type": "g5.xlarge", "max_instances": 2}
    section.update(cloud)
    return {"agent": {"cloud": section}}


def test_a_usable_configuration_reads_with_its_defaults() -> None:
    settings = CloudSettings.read(config(tags={"team": "ml"}, bootstrap={"agent_args": ["--gpus", "1"]}))
    assert (settings.max_instances, settings.idle_timeout_seconds, settings.boot_timeout_seconds) == (
        2,
        600,
        900,
    )
    assert settings.provider == "aws"
    assert settings.spot is False
    assert settings.tags == {"team": "ml"}
    assert settings.bootstrap.agent_args == ("--gpus", "1")


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"max_instances": 0}, "max_instances must be a whole number from 1"),
        ({"max_instances": -3}, "max_instances must be a whole number from 1"),
        ({"max_instances": True}, "max_instances must be a whole number from 1"),
        ({"max_instances": "4"}, "max_instances must be a whole number from 1"),
        ({"idle_timeout_seconds": 59}, "idle_timeout_seconds must be from 60 seconds"),
        ({"idle_timeout_seconds": 0}, "idle_timeout_seconds must be from 60 seconds"),
        ({"idle_timeout_seconds": float("nan")}, "idle_timeout_seconds must be from 60 seconds"),
        ({"boot_timeout_seconds": 5}, "boot_timeout_seconds must be from 30"),
        ({"provider": "gcp"}, "provider must be one of aws"),
        ({"image": ""}, "image must be a non-empty string"),
        ({"instance_type": 5}, "instance_type must be a non-empty string"),
        ({"gpus_per_instance": 0}, "gpus_per_instance must be a whole number from 1 to 64"),
        ({"spot": "yes"}, "spot must be true or false"),
        ({"tags": {"klique:instance": "x"}}, "tags must map names to values"),
        ({"tags": {"team": "a;b"}}, "tags must map names to values"),
        ({"maximum": 3}, "does not take maximum"),
        ({"bootstrap": {"work_dir": "relative"}}, "work_dir must be an absolute path"),
        ({"bootstrap": {"agent_args": "--gpus 1"}}, "agent_args must be a list of strings"),
        ({"bootstrap": {"pre": "x"}}, "does not take pre"),
    ],
)
def test_each_bad_value_is_refused_with_why(change: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        CloudSettings.read(config(**change))


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ValueError, match="max_instances") as refused:
        CloudSettings.read(config(max_instances=0, idle_timeout_seconds=1, region=""))
    assert str(refused.value).count("; ") == 2, refused.value


def test_a_missing_section_says_so() -> None:
    with pytest.raises(ValueError, match=r"no \[agent.cloud\] section"):
        CloudSettings.read({"agent": {"slurm": {}}})


TOKEN = "kqa_0a1b2c3d_Zm9vYmFy-_x"


@pytest.mark.parametrize(
    "hostile",
    [
        "http://demo.localhost:8000/$(touch /tmp/pwned)",
        "http://x/`id`",
        "http://x/'; rm -rf / #",
        'http://x/"a"\nb',
    ],
)
def test_user_data_quotes_every_value(hostile: str, tmp_path: Path) -> None:
    """The user data is a shell script: no value in it runs as a command, whatever it holds."""
    folder = tmp_path / "work dir; $(touch pwned)"
    printer = f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
    bootstrap = Bootstrap(
        install="", agent_command=printer, work_dir=str(folder), agent_args=("--gpus", "$(id)")
    )
    script = user_data(bootstrap=bootstrap, url=hostile, token=TOKEN, name="pool-1a2b3c4d")
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True)
    printed = json.loads(done.stdout)
    assert printed[printed.index("--url") + 1] == hostile
    assert printed[-2:] == ["--gpus", "$(id)"]
    assert (folder / "agent.token").read_text().strip() == TOKEN
    assert (folder / "agent.token").stat().st_mode & 0o077 == 0  # only its owner reads it
    assert TOKEN not in done.stdout  # the agent reads it from the file, never from its command line
    assert not (tmp_path / "pwned").exists()
    assert not Path("/tmp/pwned").exists()  # noqa: S108 -- where the payload would have written


@pytest.mark.parametrize("token", ["kqa_x\nrm -rf /", "kqa_$(id)", "KLIQUE_AGENT_TOKEN", "kqa_a'b"])
def test_a_token_that_could_end_the_here_document_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="an instance token is kqa_"):
        user_data(bootstrap=Bootstrap(), url="http://x", token=token, name="n-1")
