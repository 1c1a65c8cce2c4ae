"""The agents' websocket (/agents/ws/): one connection per agent, outbound from the agent's side."""

from __future__ import annotations

import logging
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django_tenants.utils import schema_context

from apps.core.consumers import header
from apps.fleet import services
from apps.fleet.models import AgentToken

logger = logging.getLogger(__name__)

REPORT_KINDS = {"status", "log", "metric", "result"}


class AgentConsumer(AsyncJsonWebsocketConsumer):
    """Speaks the agent protocol (apps.fleet.services) for one pool-scoped agent token.

    Every database step runs in the tenant's schema, named explicitly. Errors in a message are answered
    with {"type": "error", "detail": ...}; a bad token closes the connection with 4401, and a token bound
    to another agent (agent_bind) with 4403.
    """

    schema_name: str | None = None
    token: AgentToken | None = None
    agent_id: str | None = None

    async def connect(self) -> None:
        await self.accept()
        try:
            self.tenant, self.token = await database_sync_to_async(self._authenticate)()
        except services.AgentRejected as rejected:
            await self.send_json({"type": "error", "detail": str(rejected)})
            await self.close(code=4401)
            return
        self.schema_name = self.tenant.schema_name
        await self.channel_layer.group_add(
            services.pool_group(self.schema_name, self.token.pool_id), self.channel_name
        )

    def _authenticate(self) -> tuple[Any, AgentToken]:
        from tenants.selectors import tenant_for_host

        host = header(self.scope, b"host").split(":")[0].lower()
        tenant = tenant_for_host(host)
        if tenant is None or tenant.is_suspended:
            raise services.AgentRejected(f"No active tenant is served at {host!r}.")
        scheme, _, presented = header(self.scope, b"authorization").partition(" ")
        if scheme.lower() != "bearer":
            raise services.AgentRejected("Send 'Authorization: Bearer <agent token>' when connecting.")
        with schema_context(tenant.schema_name):
            return tenant, services.agent_authenticate(presented=presented.strip())

    async def disconnect(self, code: int) -> None:
        if self.token is None or self.schema_name is None:
            return
        await self.channel_layer.group_discard(
            services.pool_group(self.schema_name, self.token.pool_id), self.channel_name
        )
        if self.agent_id:
            await database_sync_to_async(self._in_schema)(services.agent_gone, agent_id=self.agent_id)

    def _in_schema(self, function: Any, **arguments: Any) -> Any:
        assert self.schema_name is not None
        with schema_context(self.schema_name):
            return function(**arguments)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if self.token is None:
            return
        kind = content.get("type") if isinstance(content, dict) else None
        try:
            await self._handle(kind, content)
        except services.AgentRejected as rejected:
            await self.send_json({"type": "error", "detail": str(rejected), "about": kind})
        except (KeyError, TypeError, ValueError) as error:
            await self.send_json(
                {"type": "error", "detail": f"Malformed {kind} message: {error}.", "about": kind}
            )

    async def _handle(self, kind: str | None, content: dict[str, Any]) -> None:
        token = self.token
        assert token is not None
        if kind == "hello":
            agent_id = str(content["agent_id"])[:100]
            client = self.scope.get("client") or ("", 0)
            try:
                await database_sync_to_async(self._in_schema)(
                    services.agent_bind,
                    tenant=self.tenant,
                    token=token,
                    agent_id=agent_id,
                    instance=str(content.get("instance") or ""),
                    address=str(client[0] or ""),
                )
            except services.AgentRejected as refused:  # a copy of another agent's token: nothing more
                await self.send_json({"type": "error", "detail": str(refused), "about": "hello"})
                await self.close(code=4403)
                return
            self.agent_id = agent_id
            welcome = await database_sync_to_async(self._in_schema)(
                services.agent_hello,
                tenant=self.tenant,
                token=token,
                agent_id=self.agent_id,
                backend=str(content.get("backend", "")),
                version=str(content.get("version", "")),
                inventory=content.get("inventory") or {},
                running=[str(t) for t in content.get("running", [])],
                capacity=content.get("capacity"),
            )
            await self.send_json(
                {
                    "type": "welcome",
                    "heartbeat_seconds": services.HEARTBEAT_SECONDS,
                    "lease_seconds": services.LEASE_SECONDS,
                    "keep": welcome.keep,
                    "abort": welcome.abort,
                }
            )
            await self._dispatch()
        elif self.agent_id is None:
            raise services.AgentRejected("Say hello first.")
        elif kind == "heartbeat":
            queue = content.get("queue")
            await database_sync_to_async(self._in_schema)(
                services.agent_heartbeat,
                tenant=self.tenant,
                token=token,
                agent_id=self.agent_id,
                queue=queue if isinstance(queue, list) else None,
                capacity=content.get("capacity"),
            )
            await self._dispatch()
        elif kind == "accepted":
            await database_sync_to_async(self._in_schema)(
                services.lease_accepted,
                pool=token.pool,
                task_id=str(content["task_id"]),
                lease_id=str(content["lease_id"]),
            )
        elif kind == "rejected":
            await database_sync_to_async(self._in_schema)(
                services.lease_rejected,
                tenant=self.tenant,
                pool=token.pool,
                task_id=str(content["task_id"]),
                lease_id=str(content["lease_id"]),
                reason=str(content.get("reason", "no reason given"))[:2000],
                permanent=bool(content.get("permanent", False)),
            )
        elif kind in REPORT_KINDS:
            body = {key: value for key, value in content.items() if key not in {"type", "task_id", "seq"}}
            await database_sync_to_async(self._in_schema)(
                services.report,
                tenant=self.tenant,
                pool=token.pool,
                task_id=str(content["task_id"]),
                seq=int(content["seq"]),
                kind=kind,
                body=body,
            )
            await self.send_json({"type": "ack", "task_id": content["task_id"], "seq": int(content["seq"])})
        else:
            raise services.AgentRejected(f"Unknown message type {kind!r}.")

    async def _dispatch(self) -> None:
        token = self.token
        assert token is not None
        assigned = await database_sync_to_async(self._in_schema)(
            services.dispatch, pool=token.pool, schema_name=self.schema_name
        )
        for message in assigned:
            await self.send_json(message)

    async def plane_message(self, event: dict[str, Any]) -> None:
        """A message for this pool's agents from elsewhere in the plane (dispatch, abort, preempt)."""
        message = event["message"]
        if message.get("type") == "revoked":
            if self.token is not None and message.get("token_id") == str(self.token.pk):
                await self.send_json({"type": "error", "detail": "This agent token was revoked."})
                await self.close(code=4401)
            return
        if message.get("type") == "dispatch":
            if self.agent_id is not None:
                await self._dispatch()
            return
        await self.send_json(message)
