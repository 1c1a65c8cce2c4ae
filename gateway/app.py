"""The OpenAI-compatible endpoints, as a plain ASGI app in front of Django (config/asgi.py sends it /v1/).

One call: who the token is (cached per token until the tenant's epoch moves, see gateway.budgets), the
tenant's guardrails on the request, a hold on every budget that applies (one Redis script), the call to a
deployment the router chose (falling back as configured), the guardrails on the reply, then the usage row
(group commit) and the settlement, before the last byte goes out. Django's request machinery is not on
this path; what needs the ORM (loading a caller or a configuration) runs in a thread when the cache is
cold.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
from channels.db import database_sync_to_async

from apps.accounts.tokens import parse_prefix
from apps.core import outbound
from gateway import services
from gateway.budgets import Budgets, epoch_key
from gateway.cache import UsageWriter, async_redis
from gateway.calls import MODES, Call, Receive, Refused, Scope, Send, TenantState
from gateway.config import Deployment
from gateway.fields import unknown_fields
from gateway.guardrails import Checker
from gateway.routing import Router
from gateway.selfhosted import TunnelTransport
from gateway.services import Caller, CallerRefused
from tenants.selectors import tenant_for_host

log = logging.getLogger("klique.gateway")

MAX_BODY = 8 * 1024 * 1024
CALLER_TTL = 60.0  # seconds: a cached caller is re-read at least this often (and at every epoch change)
MAX_CALLERS = 10_000  # cached callers per tenant address
ENDPOINTS = {
    "/v1/chat/completions": "chat/completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def _schema_for_host(host: str) -> str:
    tenant = tenant_for_host(host)
    if tenant is None or tenant.schema_name == "public":
        raise CallerRefused(
            f"No tenant is served at {host!r}; call the gateway at your tenant's own address.",
            404,
            "invalid_request_error",
            "no_tenant",
        )
    return str(tenant.schema_name)


class GatewayApp:
    def __init__(self) -> None:
        self.states: dict[str, TenantState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _bind(self) -> None:
        """Clients belong to one event loop: make them on the loop that serves the first call."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._loop = loop
        self.redis = async_redis()
        self.budgets = Budgets(self.redis)
        self.writer = UsageWriter(self.redis)
        # Upstreams are the tenant's to name: every connection is checked (apps.core.outbound).
        self.http = outbound.async_client(
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128)
        )
        # Models the tenant's apps serve are reached through their tunnels, never over the network.
        self.selfhosted = httpx.AsyncClient(transport=TunnelTransport())

    def client(self, deployment: Deployment) -> httpx.AsyncClient:
        return self.selfhosted if deployment.app else self.http

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._bind()
        request_id = f"kqr-{uuid.uuid4().hex}"
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._serve(scope, receive, tracked, request_id)
        except Refused as refused:
            await self.reply(send, refused.status, refused.body(), request_id, refused.headers)
        except CallerRefused as refused:
            error = Refused(refused.status, str(refused), refused.kind, refused.code)
            await self.reply(send, error.status, error.body(), request_id)
        except Exception as error:  # a store the gateway needs did not answer: say so, in OpenAI's format
            log.exception("gateway call failed", extra={"request_id": request_id})
            if started:
                raise
            what = "Redis" if "redis" in type(error).__module__ else "its database"
            unavailable = Refused(
                503, f"The gateway could not reach {what}; nothing was spent. Try again shortly.", "api_error"
            )
            await self.reply(send, 503, unavailable.body(), request_id, {"retry-after": "5"})

    async def reply(
        self, send: Send, status: int, body: bytes, request_id: str, extra: dict[str, str] | None = None
    ) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode()),
        ]
        headers += [(key.replace("_", "-").encode(), value.encode()) for key, value in (extra or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    # --- who, and what the tenant configured ----------------------------------------------------------

    async def state(self, host: str, *, refresh: bool = False) -> TenantState:
        state = self.states.get(host)
        if state is not None and not refresh:
            return state
        schema = state.schema if state is not None else await database_sync_to_async(_schema_for_host)(host)
        epoch = (await self.redis.get(epoch_key(schema)) or b"0").decode()  # read before what it guards
        config, keys, version = await database_sync_to_async(services.config_load)(schema)
        if state is not None and state.version == version:
            router, checker = state.router, state.checker  # same configuration: keep what routing learned
        else:
            router, checker = Router(config), Checker(config.guardrails)
        fresh = TenantState(schema, epoch, config, keys, version, router, checker)
        self.states[host] = fresh
        return fresh

    async def current_epoch(self, state: TenantState) -> str:
        return str((await self.redis.get(epoch_key(state.schema)) or b"0").decode())

    async def _caller(self, state: TenantState, scope: Scope, host: str) -> tuple[Caller, tuple[str, str]]:
        scheme, _, presented = _header(scope, b"authorization").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise Refused(
                401,
                "Send your Klique token as the API key ('Authorization: Bearer klq_...'); create one with "
                "POST /api/v1/tokens/.",
                code="invalid_api_key",
            )
        project = _header(scope, b"openai-project") or _header(scope, b"x-klique-project")
        key = (presented.strip(), project)
        cached = state.callers.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[1] < CALLER_TTL and cached[0].expires_at > datetime.now(UTC):
            return cached[0], key
        caller = await database_sync_to_async(services.caller_load)(
            host=host, presented=key[0], project=project
        )
        if len(state.callers) > MAX_CALLERS:  # many tokens within one epoch: start the cache afresh
            state.callers.clear()
        state.callers[key] = (caller, now)
        return caller, key

    # --- the endpoints --------------------------------------------------------------------------------

    async def _serve(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        if scope["type"] != "http":
            raise Refused(404, "The gateway speaks HTTP only.")
        host = _header(scope, b"host").split(":")[0].lower()
        state = await self.state(host)
        target = f"{scope['method']} {scope['path']}"
        try:
            caller, key = await self._caller(state, scope, host)
        except CallerRefused as refused:
            if refused.status == 401:  # recorded by the token's public prefix only, as the API does
                presented = _header(scope, b"authorization").partition(" ")[2].strip()
                prefix = parse_prefix(presented)
                actor = f"klq_{prefix}" if prefix else "a malformed token"
                audit = {"actor": actor, "action": "token.rejected", "target": target, "reason": str(refused)}
                await database_sync_to_async(services.audit)(state.schema, **audit)
            raise
        try:
            await self._route(
                scope, receive, send, request_id=request_id, host=host, state=state, who=(caller, key)
            )
        except Refused as refused:
            if refused.status == 403 and caller.agent:  # a delegated token used beyond what it may do
                audit = {
                    "actor": f"agent {caller.agent} for {caller.username}",
                    "on_behalf_of": caller.username,
                    "action": "token.refused",
                    "target": target,
                    "reason": str(refused),
                }
                await database_sync_to_async(services.audit)(state.schema, **audit)
            raise

    async def _route(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        request_id: str,
        host: str,
        state: TenantState,
        who: tuple[Caller, tuple[str, str]],
    ) -> None:
        caller, key = who
        path = scope["path"].rstrip("/")
        method = scope["method"]
        if path == "/v1/models" or path.startswith("/v1/models/"):
            if method != "GET":
                raise Refused(405, f"{method} is not allowed on {path}; use GET.")
            # No budget script runs here to check the epoch (see gateway.budgets): read it.
            if await self.current_epoch(state) != state.epoch:
                state = await self.state(host, refresh=True)
                caller, key = await self._caller(state, scope, host)
            await self._models(send, state, caller, path, request_id)
            return
        endpoint = ENDPOINTS.get(path)
        if endpoint is None:
            raise Refused(
                404,
                f"Unknown gateway endpoint {path}: use /v1/chat/completions, /v1/completions, "
                "/v1/embeddings or /v1/models.",
            )
        if method != "POST":
            raise Refused(405, f"{method} is not allowed on {path}; use POST.")
        body = await self._body(receive)
        call = Call(self, send, host, state, caller, key, endpoint, body, request_id)
        await call.run()

    async def _body(self, receive: Receive) -> dict[str, Any]:
        chunks, size = [], 0
        while True:
            message = await receive()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                raise Refused(413, f"The request body is over {MAX_BODY // 2**20} MiB; send less.")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        try:
            body = json.loads(b"".join(chunks))
        except ValueError:
            raise Refused(
                400, "The request body is not JSON; send a JSON object as OpenAI's API does."
            ) from None
        if not isinstance(body, dict):
            raise Refused(400, "The request body must be a JSON object.")
        return body

    def allowed_models(self, state: TenantState, caller: Caller) -> list[str]:
        names = state.config.model_names_for(caller.user_id)
        rules = state.config.guardrails.models_by_role
        if rules is not None and caller.role in rules:
            return (
                names if "*" in rules[caller.role] else [name for name in names if name in rules[caller.role]]
            )
        return [] if caller.role == "viewer" else names

    async def _models(
        self, send: Send, state: TenantState, caller: Caller, path: str, request_id: str
    ) -> None:
        allowed = self.allowed_models(state, caller)
        entries = [
            {"id": name, "object": "model", "created": 0, "owned_by": caller.tenant_slug} for name in allowed
        ]
        if path == "/v1/models":
            payload: dict[str, Any] = {"object": "list", "data": entries}
        else:
            name = path.removeprefix("/v1/models/")
            found = [entry for entry in entries if entry["id"] == name]
            if not found:
                raise Refused(
                    404,
                    f"The model {name!r} does not exist here, or you may not call it.",
                    code="model_not_found",
                )
            payload = found[0]
        await self.reply(send, 200, json.dumps(payload).encode(), request_id)

    def check_request(
        self, state: TenantState, caller: Caller, endpoint: str, body: dict[str, Any]
    ) -> tuple[str, tuple[Deployment, ...]]:
        unknown = unknown_fields(endpoint, body)
        if unknown:  # never passed on: a field such as base_url would redirect the upstream's key
            shown = ", ".join(name[:40] for name in unknown[:5])
            raise Refused(
                400,
                f"Unrecognized request argument supplied: {shown}. /v1/{endpoint} takes OpenAI's fields "
                "only; where a model is served is the gateway's configuration (a tenant admin sets it).",
                code="unknown_parameter",
            )
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise Refused(400, "Name the model to call ('model'); GET /v1/models lists them.")
        group = state.config.group(model, caller.user_id)
        if not group:
            names = (
                ", ".join(state.config.model_names_for(caller.user_id))
                or "none yet (a tenant admin configures them)"
            )
            raise Refused(
                404,
                f"The model {model!r} does not exist here. This tenant's models: {names}.",
                code="model_not_found",
            )
        if model not in self.allowed_models(state, caller):
            scope_note = " (a read-scope token may only list models)" if caller.role == "viewer" else ""
            raise Refused(
                403,
                f"{caller.username} may not call {model!r} as a {caller.role}{scope_note}; "
                "ask a tenant admin.",
                "permission_error",
                "model_not_allowed",
            )
        if group[0].mode != MODES[endpoint]:
            raise Refused(400, f"{model!r} is a {group[0].mode} model; it does not serve /v1/{endpoint}.")
        if endpoint == "chat/completions":
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) for m in messages)
            ):
                raise Refused(400, "'messages' must be a non-empty list of {role, content} objects.")
        elif endpoint == "completions" and not isinstance(body.get("prompt"), str | list):
            raise Refused(400, "'prompt' must be a string or a list of strings.")
        elif endpoint == "embeddings" and not isinstance(body.get("input"), str | list):
            raise Refused(400, "'input' must be a string or a list of strings.")
        return model, group
