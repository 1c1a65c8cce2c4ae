"""What the agent protocol refuses, as the project's own errors: the consumer and the HTTPS endpoints say
them to the agent (an error message, a close code, an HTTP status)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import messages

if TYPE_CHECKING:
    pass


class AgentRejected(Exception):
    """An agent's token or message cannot be accepted; the message says why."""


class StaleLease(AgentRejected):
    """A message about a lease that is not live; `stop` is what the agent should do with its run."""

    def __init__(self, message: str, stop: messages.Stop | None = None) -> None:
        super().__init__(message)
        self.stop = stop


class OutputNotStored(AgentRejected):
    """An upload the plane could not keep; `status` is the HTTP answer (507 full, 503 not writable: the
    agent retries; 409 a name clash, 413 too large: it does not)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
