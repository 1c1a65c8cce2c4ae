"""A run's gateway session: a key for the tenant's LLM gateway that a task (an agent session from the app
catalogue, or any task that asks) is given for as long as its run lasts, with a quota of its own.

A task asks with `"gateway_session": {"tokens": 200000}` in its spec. At dispatch the plane derives the
key from the run's lease (the same run always gets the same key; another run, another key) and registers
it with the gateway; the task gets it as `OPENAI_API_KEY`, and its agent sets `OPENAI_BASE_URL` to the
gateway's address as the agent reaches the plane. The key calls models as the task's user, never above a
member, and spends at most `tokens` (prompt and reply together) beside the user's own budgets. When the
run ends the key is dead.
"""

from __future__ import annotations

from dataclasses import dataclass

KEY_VARIABLE = "OPENAI_API_KEY"
BASE_VARIABLE = "OPENAI_BASE_URL"
KEY_KIND = "kqs"  # kqs_<task id, hex>_<signature>
MAX_TOKENS = 1_000_000_000


class SessionRefused(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class GatewaySession:
    tokens: int

    def as_json(self) -> dict[str, int]:
        return {"tokens": self.tokens}


def parse(value: object) -> GatewaySession | None:
    """The spec's `gateway_session`, or None without one; SessionRefused says what is wrong with it."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"tokens"}:
        raise SessionRefused('gateway_session: an object {"tokens": N}, N the tokens its key may spend.')
    tokens = value["tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise SessionRefused(f"gateway_session.tokens: a whole number from 1 to {MAX_TOKENS}.")
    return GatewaySession(tokens)
