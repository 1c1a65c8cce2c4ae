"""Agent tokens off the command line: read from a file only its owner reads or from the environment
(--token warns); the binding of a token to its agent is tested in tests/fleet/test_agent_binding.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.main import TOKEN_VARIABLE, agent_token, instance_key


def test_the_token_comes_from_a_file_its_owner_alone_reads(tmp_path: Path) -> None:
    file = tmp_path / "agent.token"
    file.write_text("kqa_abc_secret\n")
    for mode in (0o644, 0o640, 0o604, 0o660):
        file.chmod(mode)
        refused = agent_token(file, None, {})
        assert refused.startswith("klique-agent: the token file"), mode
        assert "chmod 600" in refused
    file.chmod(0o600)
    assert agent_token(file, None, {}) == "kqa_abc_secret"
    assert "cannot be read" in agent_token(tmp_path / "missing", None, {})


def test_the_environment_serves_and_the_command_line_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert agent_token(None, None, {TOKEN_VARIABLE: "kqa_env_secret"}) == "kqa_env_secret"
    with caplog.at_level(logging.WARNING, logger="klique.agent"):
        assert agent_token(None, "kqa_cli_secret", {}) == "kqa_cli_secret"
    assert "every user of this host can read it" in caplog.text
    assert "kqa_cli_secret" not in caplog.text
    assert "--token-file FILE (mode 600)" in agent_token(None, None, {})


def test_a_running_agent_shows_no_token_to_other_users_of_the_host(tmp_path: Path) -> None:
    file = tmp_path / "agent.token"
    file.write_text("kqa_hidden_secretvalue")
    file.chmod(0o600)
    argv = [sys.executable, "-m", "agents.main", "--url", "http://127.0.0.1:9", "--token-file", str(file)]
    process = subprocess.Popen(
        [*argv, "--gpus", "1", "--work-dir", str(tmp_path / "work")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={key: value for key, value in os.environ.items() if key != TOKEN_VARIABLE},
    )
    try:
        time.sleep(1.0)
        assert process.poll() is None
        assert b"kqa_hidden_secretvalue" not in Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert b"kqa_hidden_secretvalue" not in Path(f"/proc/{process.pid}/environ").read_bytes()
    finally:
        process.terminate()
        process.wait(timeout=15)
    key = tmp_path / "work" / "instance.key"
    assert key.stat().st_mode & 0o777 == 0o600
    assert instance_key(tmp_path / "work") == key.read_text().strip()  # made once, kept
