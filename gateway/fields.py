"""Which request fields the gateway passes to an upstream, per endpoint: OpenAI's documented fields, and
nothing else.

A caller's body must never decide where a call goes or which key it carries: LiteLLM reads `api_base`,
`base_url`, `api_key`, `custom_llm_provider`, `extra_headers` and more from its keyword arguments, so a
field passed through as "everything else" would send the vault's upstream key to the caller's own
server. Where a call goes comes from the tenant's gateway configuration only. A field outside the list
is refused with a 400 naming it, as OpenAI's own API answers an unrecognized argument; and the payload
an upstream gets is rebuilt from the list, so no later step can pass one through either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SAMPLING = frozenset(
    {
        "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed",
        "stop", "stream", "stream_options", "temperature", "top_p", "user",
    }
)  # fmt: skip

_CHAT = frozenset(
    {
        "model", "messages", "top_logprobs", "max_completion_tokens", "response_format", "tools",
        "tool_choice", "parallel_tool_calls", "functions", "function_call", "modalities", "audio",
        "prediction", "reasoning_effort", "service_tier", "web_search_options", "verbosity",
    }
)  # fmt: skip

REQUEST_FIELDS: dict[str, frozenset[str]] = {
    "chat/completions": _SAMPLING | _CHAT,
    "completions": _SAMPLING | {"model", "prompt", "best_of", "echo", "suffix"},
    "embeddings": frozenset({"model", "input", "encoding_format", "dimensions", "user"}),
}


def unknown_fields(endpoint: str, body: Mapping[str, Any]) -> list[str]:
    """The body's fields that /v1/<endpoint> does not take, sorted."""
    allowed = REQUEST_FIELDS[endpoint]
    return sorted(str(name) for name in body if name not in allowed)


def upstream_payload(endpoint: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The body reduced to the endpoint's fields: what an upstream may be sent."""
    allowed = REQUEST_FIELDS[endpoint]
    return {name: value for name, value in body.items() if name in allowed}
