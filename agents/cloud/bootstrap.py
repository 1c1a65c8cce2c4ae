"""The user data a new instance boots with: it writes the instance's own agent token to a file only root
reads, installs the agent and starts it as a bare-metal agent of the pool under the instance's name.

The token is short-lived (good for its first hello only until the plane's deadline) and scoped to the
pool; it dies when the instance ends. Every value is quoted for the shell; the token goes through a
quoted here-document, never through a command line.
"""

from __future__ import annotations

import re
import shlex

from agents.cloud.settings import Bootstrap

_TOKEN = re.compile(r"^kqa_[A-Za-z0-9_-]{1,200}$")


def user_data(*, bootstrap: Bootstrap, url: str, token: str, name: str) -> str:
    if not _TOKEN.match(token):
        raise ValueError("an instance token is kqa_ and letters, digits, _ and -")
    folder = bootstrap.work_dir.replace("{name}", name).rstrip("/") or "/"
    token_file = f"{folder}/agent.token"
    command = [
        *shlex.split(bootstrap.agent_command),
        "--url", url,
        "--token-file", token_file,
        "--backend", "baremetal",
        "--agent-id", name,
        "--work-dir", folder,
        *bootstrap.agent_args,
    ]  # fmt: skip
    lines = [
        "#!/bin/sh",
        f"# Klique: the agent of cloud instance {name}",
        "set -eu",
        "umask 077",
        f"mkdir -p {shlex.quote(folder)}",
        f"cat > {shlex.quote(token_file)} <<'KLIQUE_AGENT_TOKEN'",
        token,
        "KLIQUE_AGENT_TOKEN",
    ]
    if bootstrap.install.strip():
        lines.append(bootstrap.install.strip())
    lines.append("exec " + " ".join(shlex.quote(word) for word in command))
    return "\n".join(lines) + "\n"
