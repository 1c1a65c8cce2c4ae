"""Apps on an HPC pool: the app runs in a batch job on a compute node, and the agent on the login node
reaches it for the app's tunnel.

The job's node reporter (agents.node) starts the app on the node's loopback, on a port it picks there,
and opens a *relay* beside it on a port of the node's network that leads to the app only for a caller who
first sends the run's app key (`HELLO` + key + newline, answered with `ANSWER`); it writes the relay's and
the app's ports to `app-address` in the task's folder. The key is made by the agent for each run and kept
in the task's folder (mode 600, the job's account's), so only the agent and the job's own account can
reach the app: another user of the cluster who finds the port gets a closed connection.

The agent takes the node from the cluster's own view of the running job (never from the folder, which
the account writes), the ports from the folder, and the key it wrote, and reaches the app through its end
of the relay (agents.relay.NodeRelay).
"""

from __future__ import annotations

import json

ADDRESS_FILE = "app-address"


class AddressInvalid(ValueError):
    """What the job wrote of its app's address cannot be used."""


def ports(text: str | None) -> tuple[int, int] | None:
    """The relay's and the app's ports from `app-address` as the job wrote it; None while it has not
    (no file yet, or one half written); AddressInvalid for a file that is not what a node reporter
    writes."""
    if not text:
        return None
    try:
        document = json.loads(text)
    except ValueError:
        raise AddressInvalid("it is not JSON") from None
    if not isinstance(document, dict) or set(document) != {"relay", "app"}:
        raise AddressInvalid('it is not {"relay": <port>, "app": <port>}')
    found = document["relay"], document["app"]
    if not all(type(port) is int and 1024 <= port <= 65535 for port in found):
        raise AddressInvalid("its ports are not whole numbers from 1024 to 65535")
    return found
