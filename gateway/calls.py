"""One gateway call, from the budgets' hold to the last byte: routing, the upstream, guardrails on the
reply, metering. gateway.app decides who calls and what they may call, then hands the call to `Call`."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import httpx
from channels.db import database_sync_to_async

from apps.core.metrics import GATEWAY_CALLS, GATEWAY_LATENCY, GATEWAY_TOKENS
from gateway import services
from gateway.budgets import Budgets, Exhausted, Missing, Reserved, Stale, nano_per_token
from gateway.cache import UsageRow, UsageWriter
from gateway.config import Deployment, GatewayConfig
from gateway.guardrails import Checker, GuardrailRefused, StreamGuard
from gateway.routing import NoDeployment, Router
from gateway.services import Caller
from gateway.upstream import UpstreamError, call, stream

log = logging.getLogger("klique.gateway")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MODES = {"chat/completions": "chat", "completions": "completion", "embeddings": "embedding"}
MAX_REPLIES = 16  # `n`, the replies one call may ask for
EVENT_STREAM = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Refused(Exception):
    """A call refused with an OpenAI-style error."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        **headers: str,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code
        self.headers = headers

    def body(self) -> bytes:
        error = {"message": str(self), "type": self.kind, "param": None, "code": self.code}
        return json.dumps({"error": error}).encode()


def _upstream_refusal(error: UpstreamError) -> Refused:
    kind = "invalid_request_error" if error.status < 500 else "api_error"
    return Refused(error.status, str(error), kind, "upstream_error")


def estimate_tokens(text: str) -> int:
    """An estimate of a text's tokens that errs high for the tokenizers in use (about 4 bytes a token)."""
    return math.ceil(len(text.encode()) / 3) + 1


def prompt_estimate(endpoint: str, body: dict[str, Any]) -> int:
    if endpoint == "chat/completions":
        total = 3
        for message in body["messages"]:
            content = message.get("content")
            if isinstance(content, list):
                content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
            total += 4 + estimate_tokens(str(content or ""))
        for extra in ("tools", "functions", "response_format"):  # sent to the model with the prompt
            if body.get(extra):
                total += estimate_tokens(json.dumps(body[extra]))
        return total
    value = body.get("prompt" if endpoint == "completions" else "input", "")
    items = value if isinstance(value, list) else [value]
    return sum(estimate_tokens(str(item)) for item in items)


@dataclass
class TenantState:
    """What one process knows about one tenant address, valid while `epoch` is the tenant's epoch."""

    schema: str
    epoch: str
    config: GatewayConfig
    keys: dict[str, str]
    version: str
    router: Router
    checker: Checker
    callers: dict[tuple[str, str], tuple[Caller, float]] = field(default_factory=dict)


def guard_request(checker: Checker, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    if endpoint == "chat/completions":
        return {**body, "messages": checker.messages(body["messages"])}
    key = "prompt" if endpoint == "completions" else "input"
    value = body[key]
    if isinstance(value, list):
        return {**body, key: [checker.text(v, where="prompt") if isinstance(v, str) else v for v in value]}
    return {**body, key: checker.text(str(value), where="prompt")}


def guard_reply(checker: Checker, result: dict[str, Any]) -> None:
    for choice in result.get("choices") or []:
        message = choice.get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message["content"] = checker.text(message["content"], where="reply")
        elif isinstance(choice.get("text"), str):
            choice["text"] = checker.text(choice["text"], where="reply")


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class Gateway(Protocol):
    """What a call needs of the gateway that hands it over (gateway.app.GatewayApp)."""

    budgets: Budgets
    writer: UsageWriter
    http: httpx.AsyncClient

    def client(self, deployment: Deployment) -> httpx.AsyncClient: ...

    def check_request(
        self, state: TenantState, caller: Caller, endpoint: str, body: dict[str, Any]
    ) -> tuple[str, tuple[Deployment, ...]]: ...

    async def state(self, host: str, *, refresh: bool = False) -> TenantState: ...

    async def current_epoch(self, state: TenantState) -> str: ...

    async def reply(
        self, send: Send, status: int, body: bytes, request_id: str, extra: dict[str, str] | None = None
    ) -> None: ...


@dataclass
class Call:
    app: Gateway
    send: Send
    host: str
    state: TenantState
    caller: Caller
    key: tuple[str, str]  # the token and the project asked for: the caller's cache key
    endpoint: str
    body: dict[str, Any]
    request_id: str
    started: float = field(default_factory=time.monotonic)
    at: datetime = field(default_factory=lambda: datetime.now(UTC))
    model: str = ""
    prompt: int = 0  # the prompt's estimate, where the upstream reports no usage
    reserved: Reserved | None = None
    replies: int = 1  # `n`: each reply may be max_tokens long
    limited: bool = False  # a budget lowered max_tokens
    settled: bool = False

    async def run(self) -> None:
        """Check the call against what this process knows of the tenant, hold its cost, call upstream.

        What the process knows is checked by the budget script (the tenant's epoch): when it is out of
        date, the call is checked again against what the tenant has now, and a refusal drawn from the
        cache is only given once the cache is known to be current."""
        request = self.body
        for _ in range(3):
            try:
                wanted = self._prepare(request)
            except Refused:
                if await self._refreshed():
                    continue
                raise
            try:
                self.reserved = await self._reserve(wanted)
                break
            except Stale:
                await self._refresh()
            except Exhausted as exhausted:
                raise Refused(429, exhausted.sentence(), "insufficient_quota", "insufficient_quota") from None
        else:
            message = "The gateway's configuration kept changing during this call; send it again."
            raise Refused(503, message, "api_error")
        payload = dict(self.body)
        if self.endpoint != "embeddings":
            self.limited = self.reserved.max_tokens < wanted
            payload.pop("max_completion_tokens", None)
            payload["max_tokens"] = self.reserved.max_tokens
        try:
            if payload.get("stream") and self.endpoint != "embeddings":
                await self._streamed(payload)
            else:
                await self._whole(payload)
        except BaseException:
            if not self.settled:
                try:
                    await self.fail()
                except Exception:  # the hold is swept later; the first error is the one to report
                    log.exception("could not give back a call's hold", extra={"request_id": self.request_id})
            raise

    def _prepare(self, request: dict[str, Any]) -> int:
        """Check the request and apply the guardrails; the reply's length the call asks to hold."""
        self.model, group = self.app.check_request(self.state, self.caller, self.endpoint, request)
        checker = self.state.checker
        try:
            self.body = guard_request(checker, self.endpoint, request)
            requested = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
            if requested is not None and (
                isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
            ):
                raise Refused(400, f"max_tokens must be a whole number of at least 1 (got {requested!r}).")
            replies = self.body.get("n", 1)
            if isinstance(replies, bool) or not isinstance(replies, int) or not 1 <= replies <= MAX_REPLIES:
                raise Refused(400, f"n must be a whole number from 1 to {MAX_REPLIES} (got {replies!r}).")
            self.replies = replies
            self.prompt = prompt_estimate(self.endpoint, self.body)
            if self.endpoint == "embeddings":
                return 0
            return checker.max_tokens(requested, min(deployment.max_output_tokens for deployment in group))
        except GuardrailRefused as refused:
            raise Refused(400, str(refused), "invalid_request_error", refused.code) from None

    async def _refresh(self) -> None:
        """Read the tenant's configuration and this caller again (the epoch moved)."""
        self.state = await self.app.state(self.host, refresh=True)
        self.caller = await database_sync_to_async(services.caller_load)(
            host=self.host, presented=self.key[0], project=self.key[1]
        )
        self.state.callers[self.key] = (self.caller, time.monotonic())

    async def _refreshed(self) -> bool:
        """Refresh if the tenant's epoch moved since the cache was filled; whether it did."""
        if await self.app.current_epoch(self.state) == self.state.epoch:
            return False
        await self._refresh()
        return True

    # --- budgets ----------------------------------------------------------------------------------------

    async def _reserve(self, wanted: int) -> Reserved:
        config = self.state.config
        fallbacks = config.router.fallbacks.get(self.model, ())
        user = self.caller.user_id
        candidates = [
            *config.group(self.model, user),
            *(d for name in fallbacks for d in config.group(name, user)),
        ]
        prices = {
            "price_in": max(nano_per_token(d.input_cost_per_million) for d in candidates),
            "price_out": max(nano_per_token(d.output_cost_per_million) for d in candidates),
        }
        for _ in range(len(self.caller.budgets) + 1):
            try:
                return await self.app.budgets.reserve(
                    schema=self.state.schema,
                    epoch=self.state.epoch,
                    request_id=self.request_id,
                    budgets=self.caller.budgets,
                    prompt_tokens=self.prompt,
                    max_tokens=wanted,
                    replies=self.replies,
                    now=self.at,
                    **prices,
                )
            except Missing as missing:  # a new period, or Redis lost it: start from the ledger
                spent = await database_sync_to_async(services.ledger_spent_in)(
                    self.state.schema, missing.budget, self.at
                )
                await self.app.budgets.start(missing.key, spent, missing.budget, self.at)
        raise Refused(503, "The budgets' counters could not be started; send the call again.", "api_error")

    def budget_error(self) -> dict[str, Any]:
        assert self.reserved is not None
        return {
            "message": f"A budget ran out: the reply was cut after {self.reserved.max_tokens} tokens. "
            "Ask a tenant admin to raise or top up the budget.",
            "type": "insufficient_quota",
            "code": "budget_exhausted",
        }

    def _row(self, deployment: str, tokens_in: int, tokens_out: int, cost: int, status: str) -> UsageRow:
        tenant = self.caller.tenant_slug
        GATEWAY_CALLS.labels(tenant, self.model, status).inc()
        GATEWAY_TOKENS.labels(tenant, self.model, "in").inc(tokens_in)
        GATEWAY_TOKENS.labels(tenant, self.model, "out").inc(tokens_out)
        GATEWAY_LATENCY.labels(self.model).observe(time.monotonic() - self.started)
        return UsageRow(
            request_id=self.request_id,
            at=self.at,
            user_id=self.caller.user_id,
            username=self.caller.username,
            project_id=self.caller.project_id,
            project_name=self.caller.project_name,
            token_prefix=self.caller.token_prefix,
            agent=self.caller.agent,
            endpoint=self.endpoint.replace("/", "."),
            model=self.model,
            deployment=deployment,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            cost_nano_usd=cost,
            status=status,
            duration_ms=int((time.monotonic() - self.started) * 1000),
        )

    async def settle(self, deployment: Deployment, tokens_in: int, tokens_out: int, status: str) -> None:
        """Meter what the call made: the usage row first (the ledger is the truth), then the budgets."""
        assert self.reserved is not None
        self.settled = True
        price_in = nano_per_token(deployment.input_cost_per_million)
        price_out = nano_per_token(deployment.output_cost_per_million)
        cost = tokens_in * price_in + tokens_out * price_out
        await self.app.writer.write(
            self.state.schema, self._row(deployment.id, tokens_in, tokens_out, cost, status)
        )
        costs = [budget.cost(tokens_in, tokens_out, price_in, price_out) for budget in self.caller.budgets]
        await self.app.budgets.settle(
            schema=self.state.schema, request_id=self.request_id, keys=self.reserved.keys, costs=costs
        )

    async def fail(self, deployment: Deployment | None = None) -> None:
        """Nothing was made: give the holds back and record the failed call, at no cost."""
        self.settled = True
        if self.reserved is not None:
            await self.app.budgets.release(
                schema=self.state.schema, request_id=self.request_id, keys=self.reserved.keys
            )
        row = self._row(deployment.id if deployment else "", 0, 0, 0, "failed")
        await self.app.writer.write(self.state.schema, row)

    # --- the upstream -----------------------------------------------------------------------------------

    async def _deployments(self) -> AsyncIterator[Deployment]:
        try:
            for deployment in self.state.router.plan(self.model, self.caller.user_id):
                yield deployment
        except NoDeployment as none:
            retry = f"{math.ceil(none.retry_after or 1)}"
            raise Refused(503, str(none), "api_error", "no_deployment", retry_after=retry) from None

    def _key(self, deployment: Deployment) -> str:
        return self.state.keys.get(deployment.api_key_secret, "")

    async def _unanswered(self, failures: list[str]) -> None:
        await self.fail()
        message = f"No deployment of {self.model!r} answered: " + " | ".join(failures)
        raise Refused(502, message, "api_error", "upstream_unavailable")

    async def _whole(self, payload: dict[str, Any]) -> None:
        assert self.reserved is not None
        router = self.state.router
        failures: list[str] = []
        async for deployment in self._deployments():
            started = router.started(deployment)
            try:
                result = await call(
                    self.app.client(deployment),
                    deployment,
                    self._key(deployment),
                    self.endpoint,
                    {**payload, "model": deployment.model},
                )
            except UpstreamError as error:
                router.failed(deployment)
                if not error.retryable:
                    await self.fail(deployment)
                    raise _upstream_refusal(error) from None
                failures.append(str(error))
                continue
            router.succeeded(deployment, started)
            result["model"] = self.model
            usage = result.get("usage") or {}
            refusal: GuardrailRefused | None = None
            if self.state.config.guardrails.check_output and self.endpoint != "embeddings":
                try:
                    guard_reply(self.state.checker, result)
                except GuardrailRefused as refused:
                    refusal = refused
            tokens_in = int(usage.get("prompt_tokens") or self.prompt)
            tokens_out = int(usage.get("completion_tokens") or 0)
            await self.settle(deployment, tokens_in, tokens_out, "refused" if refusal else "ok")
            if refusal is not None:
                raise Refused(400, str(refusal), "invalid_request_error", refusal.code)
            extra = {"x-klique-budget-limited": str(self.reserved.max_tokens)} if self.limited else {}
            await self.app.reply(self.send, 200, json.dumps(result).encode(), self.request_id, extra)
            return
        await self._unanswered(failures)

    async def _streamed(self, payload: dict[str, Any]) -> None:
        """A stream may move to another deployment until its first chunk arrives, not after."""
        wants_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        payload = {**payload, "stream_options": {"include_usage": True}}
        router = self.state.router
        failures: list[str] = []
        async for deployment in self._deployments():
            started = router.started(deployment)
            chunks = stream(
                self.app.client(deployment),
                deployment,
                self._key(deployment),
                self.endpoint,
                {**payload, "model": deployment.model},
            )
            try:
                first = await anext(chunks, None)
            except UpstreamError as error:
                router.failed(deployment)
                if not error.retryable:
                    await self.fail(deployment)
                    raise _upstream_refusal(error) from None
                failures.append(str(error))
                continue
            await Relay(self, deployment, wants_usage).run(first, chunks, started)
            return
        await self._unanswered(failures)


@dataclass
class Relay:
    """A stream that has begun: relayed chunk by chunk, its reply checked as it goes, cut where a budget or a
    guardrail says so (with an error event, which OpenAI's clients raise), metered before its last event."""

    call: Call
    deployment: Deployment
    wants_usage: bool
    usage: dict[str, Any] = field(default_factory=dict)
    counted: int = 0  # content chunks: the reply's tokens where the upstream reports no usage
    finish: str | None = None
    template: dict[str, Any] = field(default_factory=dict)  # id, created, model of the stream's chunks

    def _content(self, text: str) -> bytes:
        return _event(
            {**self.template, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        )

    async def _send(self, body: bytes, *, more: bool = True) -> None:
        await self.call.send({"type": "http.response.body", "body": body, "more_body": more})

    async def run(
        self, first: dict[str, Any] | None, chunks: AsyncIterator[dict[str, Any]], started: float
    ) -> None:
        call = self.call
        assert call.reserved is not None
        headers = [*EVENT_STREAM, (b"x-request-id", call.request_id.encode())]
        if call.limited:
            headers.append((b"x-klique-budget-limited", str(call.reserved.max_tokens).encode()))
        await call.send({"type": "http.response.start", "status": 200, "headers": headers})
        guard = StreamGuard(call.state.checker) if call.state.config.guardrails.check_output else None
        error: dict[str, Any] | None = None
        try:
            error = await self._pump(first, chunks, guard)
            if error is None:
                call.state.router.succeeded(self.deployment, started)
        except GuardrailRefused as refused:
            error = {"message": str(refused), "type": "invalid_request_error", "code": refused.code}
        except UpstreamError as broke:
            call.state.router.failed(self.deployment)
            error = {"message": str(broke), "type": "api_error", "code": "upstream_error"}
        tail = b""
        if guard is not None and error is None and (rest := guard.finish()):
            tail += self._content(rest)
        if error is None and call.limited and self.finish == "length":
            error = call.budget_error()
        tokens_in = int(self.usage.get("prompt_tokens") or call.prompt)
        tokens_out = max(int(self.usage.get("completion_tokens") or 0), self.counted)
        await call.settle(self.deployment, tokens_in, tokens_out, "ok" if error is None else "cut")
        if self.wants_usage and self.usage:
            tail += _event({**self.template, "choices": [], "usage": self.usage})
        if error is not None:
            tail += _event({"error": {**error, "param": None}})
        await self._send(tail + b"data: [DONE]\n\n", more=False)

    async def _pump(
        self, chunk: dict[str, Any] | None, chunks: AsyncIterator[dict[str, Any]], guard: StreamGuard | None
    ) -> dict[str, Any] | None:
        """Relay chunks until the stream ends (None) or must be cut (the error to end it with)."""
        call = self.call
        assert call.reserved is not None
        while chunk is not None:
            if chunk.get("usage"):
                self.usage = chunk.pop("usage")
            choices = chunk.get("choices") or []
            if choices:
                chunk["model"] = call.model
                self.template = {key: value for key, value in chunk.items() if key != "choices"}
                for choice in choices:
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        self.counted += 1
                        if guard is not None:
                            delta["content"] = guard.feed(delta["content"])
                    self.finish = choice.get("finish_reason") or self.finish
                if self.counted > call.reserved.max_tokens * call.replies:  # the upstream ignored max_tokens
                    return call.budget_error()
                if self.finish is not None and guard is not None and (rest := guard.finish()):
                    await self._send(self._content(rest))
                await self._send(_event(chunk))
            chunk = await anext(chunks, None)
        return None
