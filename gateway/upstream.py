"""Calling a deployment: OpenAI-compatible servers directly over HTTP, any other provider through LiteLLM.

Most deployments speak OpenAI's API (OpenAI itself, vLLM, SGLang, llama.cpp, LM Studio): the gateway posts
the request as the client sent it, with the deployment's model name and key, and relays what comes back,
streaming included, so nothing is translated twice. Other providers (Anthropic, Bedrock, Vertex AI, ...)
go through LiteLLM's adapters, which translate to and from OpenAI's format; LiteLLM is imported the first
time such a deployment is called, since importing it takes seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx

from apps.core import outbound
from gateway.config import Deployment
from gateway.fields import upstream_payload

OPENAI_BASE = "https://api.openai.com/v1"
# Worth trying another deployment after these: the next one may be up, or hold a key that works.
RETRYABLE = frozenset({401, 403, 408, 409, 429, 500, 502, 503, 504})


class UpstreamError(Exception):
    """A deployment did not answer, or answered with an error. `retryable`: another deployment may."""

    def __init__(self, message: str, *, status: int = 502, retryable: bool = True, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.body = body


def _error_message(response: httpx.Response) -> str:
    """What an upstream said was wrong: the message of an OpenAI-style error, else only the status's
    phrase. Never the body itself, which could be anything the address answers (a tenant must not read
    other servers' pages through the gateway's errors)."""
    try:
        body = response.json()
    except ValueError:
        return response.reason_phrase or "an error"
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message)[:300] if isinstance(message, str) else (response.reason_phrase or "an error")


def _what(deployment: Deployment, error: httpx.HTTPError) -> str:
    """An error's kind; for a model an app serves, also what the gateway's own transport said of it (never
    a remote server's words)."""
    return f"{type(error).__name__} ({error})" if deployment.app and str(error) else type(error).__name__


def _url(deployment: Deployment, endpoint: str) -> str:
    return f"{deployment.api_base or OPENAI_BASE}/{endpoint}"


def _headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def _raise_for(deployment: Deployment, response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    await response.aread()
    message = f"{deployment.id} answered {response.status_code}: {_error_message(response)}"
    if response.status_code in (401, 403):
        secret = deployment.api_key_secret or "(none named)"
        message += f" (it refused the key in vault secret {secret}; a tenant admin should check it)"
    raise UpstreamError(message, status=response.status_code, retryable=response.status_code in RETRYABLE)


async def call(
    client: httpx.AsyncClient, deployment: Deployment, key: str, endpoint: str, payload: dict[str, Any]
) -> dict[str, Any]:
    """One non-streamed call; the upstream's JSON body."""
    if not deployment.openai_compatible:
        return await _litellm_call(deployment, key, endpoint, payload)
    try:
        response = await client.post(
            _url(deployment, endpoint),
            json=upstream_payload(endpoint, payload),
            headers=_headers(key),
            timeout=deployment.timeout,
        )
    except outbound.OutboundRefused as refused:
        raise UpstreamError(f"{deployment.id}: {refused}", status=502, retryable=True) from None
    except httpx.HTTPError as error:
        raise UpstreamError(f"{deployment.id} did not answer: {_what(deployment, error)}") from None
    await _raise_for(deployment, response)
    try:
        body: dict[str, Any] = response.json()
    except ValueError:
        raise UpstreamError(f"{deployment.id} answered with something other than JSON.") from None
    return body


async def stream(
    client: httpx.AsyncClient, deployment: Deployment, key: str, endpoint: str, payload: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """A streamed call's chunks, parsed. Errors before the first chunk raise UpstreamError (retryable)."""
    if not deployment.openai_compatible:
        async for chunk in _litellm_stream(deployment, key, endpoint, payload):
            yield chunk
        return
    request = client.build_request(
        "POST",
        _url(deployment, endpoint),
        json=upstream_payload(endpoint, payload),
        headers=_headers(key),
        timeout=deployment.timeout,
    )
    try:
        response = await client.send(request, stream=True)
    except outbound.OutboundRefused as refused:
        raise UpstreamError(f"{deployment.id}: {refused}", status=502, retryable=True) from None
    except httpx.HTTPError as error:
        raise UpstreamError(f"{deployment.id} did not answer: {_what(deployment, error)}") from None
    try:
        await _raise_for(deployment, response)
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if isinstance(chunk, dict) and chunk.get("error"):
                raise UpstreamError(f"{deployment.id} failed mid-stream: {chunk['error']}", retryable=False)
            yield chunk
    except httpx.HTTPError as error:
        raise UpstreamError(f"{deployment.id} broke off: {type(error).__name__}", retryable=False) from None
    finally:
        await response.aclose()


# --- LiteLLM, for providers that do not speak OpenAI's API ---------------------------------------------


def _litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the price map at import
    import litellm  # noqa: PLC0415 -- 7 s to import: loaded on the first call, not at startup

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    return litellm


def litellm_providers() -> set[str]:
    return {str(getattr(provider, "value", provider)) for provider in _litellm().provider_list}


def _litellm_arguments(
    deployment: Deployment, key: str, endpoint: str, payload: dict[str, Any]
) -> dict[str, Any]:
    """LiteLLM's keyword arguments: the request's OpenAI fields, then where and with which key it goes,
    from the configuration only (LiteLLM would take api_base or api_key from any keyword)."""
    arguments = {k: v for k, v in upstream_payload(endpoint, payload).items() if k != "model"}
    arguments["model"] = f"{deployment.provider}/{deployment.model}"
    arguments["timeout"] = deployment.timeout
    if deployment.api_base:
        arguments["api_base"] = deployment.api_base
    if key:
        arguments["api_key"] = key
    return arguments


async def _check_litellm_address(deployment: Deployment) -> None:
    """LiteLLM opens its own connections: its api_base is checked just before (a name that resolves
    elsewhere between this check and LiteLLM's own resolution is the one gap; docs/gateway.md)."""
    if not deployment.api_base:
        return  # the provider's own public address, as LiteLLM knows it
    try:
        await asyncio.get_running_loop().run_in_executor(None, outbound.check_url, deployment.api_base)
    except outbound.OutboundRefused as refused:
        raise UpstreamError(f"{deployment.id}: {refused}", status=502, retryable=True) from None


def _litellm_error(deployment: Deployment, error: Exception) -> UpstreamError:
    status = int(getattr(error, "status_code", 502) or 502)
    return UpstreamError(f"{deployment.id} failed: {error}", status=status, retryable=status in RETRYABLE)


async def _litellm_call(
    deployment: Deployment, key: str, endpoint: str, payload: dict[str, Any]
) -> dict[str, Any]:
    await _check_litellm_address(deployment)
    litellm = _litellm()
    function = {
        "chat/completions": litellm.acompletion,
        "completions": litellm.atext_completion,
        "embeddings": litellm.aembedding,
    }[endpoint]
    try:
        response = await function(**_litellm_arguments(deployment, key, endpoint, payload))
    except Exception as error:  # LiteLLM maps every provider's errors onto its own classes
        raise _litellm_error(deployment, error) from None
    body: dict[str, Any] = response.model_dump(exclude_none=True)
    return body


async def _litellm_stream(
    deployment: Deployment, key: str, endpoint: str, payload: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    await _check_litellm_address(deployment)
    litellm = _litellm()
    try:
        response = await litellm.acompletion(**_litellm_arguments(deployment, key, endpoint, payload))
    except Exception as error:
        raise _litellm_error(deployment, error) from None
    try:
        async for chunk in response:
            yield chunk.model_dump(exclude_none=True)
    except Exception as error:
        raise UpstreamError(f"{deployment.id} broke off: {error}", retryable=False) from None
