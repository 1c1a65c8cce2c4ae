"""Agent tokens (one per agent, bound at its first hello) and task tokens (one run's, for its compute
nodes' reports and uploads)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.tokens import hash_token
from apps.audit.services import record
from apps.core.events import publish_event
from apps.core.ids import as_uuid
from apps.fleet.models import AgentToken
from apps.resources.models import Pool
from apps.scheduling import wake
from apps.scheduling.models import Task, TaskState
from protocol import sessions
from tenants.selectors import tenant_for_host

if TYPE_CHECKING:
    from tenants.models import Tenant
from apps.fleet.errors import AgentRejected

logger = logging.getLogger(__name__)


AGENT_TOKEN_KIND = "kqa"  # noqa: S105 -- the kind of token (kqa_<prefix>_<secret>), not a secret


TASK_TOKEN_KIND = "kqt"  # noqa: S105 -- kqt_<task id>_<signature>, not a secret


@dataclass(frozen=True)
class IssuedAgentToken:
    token: AgentToken
    secret: str


def agent_token_create(*, pool: Pool, name: str) -> IssuedAgentToken:
    """A token that lets one agent serve `pool`; shown once."""

    prefix = secrets.token_hex(4)
    secret = f"{AGENT_TOKEN_KIND}_{prefix}_{secrets.token_urlsafe(24)}"
    token = AgentToken.objects.create(pool=pool, name=name, prefix=prefix, secret_hash=hash_token(secret))
    return IssuedAgentToken(token, secret)


def instance_token_create(*, autoscaler: AgentToken, agent_id: str, expires_at: datetime) -> IssuedAgentToken:
    """A token for one cloud instance's agent, minted by its pool's autoscaler: bound to `agent_id` from the
    start, and good for its first hello only until `expires_at`."""
    prefix = secrets.token_hex(4)
    secret = f"{AGENT_TOKEN_KIND}_{prefix}_{secrets.token_urlsafe(24)}"
    token = AgentToken.objects.create(
        pool_id=autoscaler.pool_id,
        name=f"instance {agent_id}"[:100],
        prefix=prefix,
        secret_hash=hash_token(secret),
        instance_of=autoscaler,
        expires_at=expires_at,
        bound_agent_id=agent_id,
    )
    return IssuedAgentToken(token, secret)


def agent_token_revoke(*, tenant: Tenant, token: AgentToken) -> AgentToken:
    """Revoke at once: new connections are refused, and a connected agent using it is disconnected. The
    tokens an autoscaler minted for its instances go with its own."""
    now = timezone.now()
    for revoked in [token, *AgentToken.objects.filter(instance_of=token, revoked_at=None)]:
        if revoked.revoked_at is None:
            revoked.revoked_at = now
            revoked.save(update_fields=["revoked_at"])
            wake.notify_pool(
                tenant=tenant,
                pool_id=revoked.pool_id,
                message={"type": "revoked", "token_id": str(revoked.pk)},
            )
    return token


def agent_authenticate(*, presented: str) -> AgentToken:
    parts = presented.split("_", 2)  # the secret itself may contain underscores
    if len(parts) != 3 or parts[0] != AGENT_TOKEN_KIND:
        raise AgentRejected("Malformed agent token: expected kqa_<prefix>_<secret>, as issued for the pool.")
    token = AgentToken.objects.select_related("pool").filter(prefix=parts[1]).first()
    if token is None or not hmac.compare_digest(token.secret_hash, hash_token(presented)):
        raise AgentRejected(
            "Unknown agent token for this tenant; issue one with POST /api/v1/pools/{id}/agent-tokens/."
        )
    if token.revoked_at is not None:
        raise AgentRejected(
            f"Agent token kqa_{token.prefix} was revoked; issue a new one for pool {token.pool.name}."
        )
    if token.bound_at is None and token.expires_at is not None and token.expires_at < timezone.now():
        raise AgentRejected(
            f"Agent token kqa_{token.prefix} was good for its instance's first connection until "
            f"{token.expires_at:%Y-%m-%d %H:%M:%S} UTC; the autoscaler of pool {token.pool.name} ends the "
            "instance and starts another."
        )
    AgentToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    return token


def agent_at_handshake(*, host: str, authorization: str) -> tuple[Tenant, AgentToken]:
    """The tenant served at a websocket handshake's Host and the agent token its Authorization presents
    (checked in that tenant's schema); AgentRejected saying what to send."""
    name = host.split(":", maxsplit=1)[0].lower()
    tenant = tenant_for_host(name)
    if tenant is None or tenant.is_suspended:
        raise AgentRejected(f"No active tenant is served at {name!r}.")
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer":
        raise AgentRejected("Send 'Authorization: Bearer <agent token>' when connecting.")
    with schema_context(tenant.schema_name):
        return tenant, agent_authenticate(presented=presented.strip())


def instance_fingerprint(instance: str) -> str:
    """What a token keeps of the instance key of the agent it is bound to (a hash: never the key)."""
    return hashlib.sha256(instance.encode()).hexdigest() if instance else ""


def is_bound_to(token: AgentToken, instance: str) -> bool:
    """Whether `token` is bound to the agent holding instance key `instance` (it said hello before)."""
    fingerprint = instance_fingerprint(instance)
    if not token.bound_agent_id or not fingerprint:
        return False
    return hmac.compare_digest(token.bound_instance, fingerprint)


def agent_bind(*, tenant: Tenant, token: AgentToken, agent_id: str, instance: str, address: str = "") -> None:
    """Bind the token to the agent at its first hello; refuse another agent presenting it later.

    The binding is the agent's id and a hash of the random instance key it keeps in its work folder, so a
    token copied from a login node (a process list, a backup) is refused wherever it is used without that
    agent's key. The refusal is kept on the token, audited and published, for the pool's admins."""
    fingerprint = instance_fingerprint(instance)
    with transaction.atomic():
        current = AgentToken.objects.select_for_update().get(pk=token.pk)
        # Unbound, or an instance's token (named for its agent) at that agent's first hello.
        if not current.bound_agent_id or (current.bound_at is None and current.bound_agent_id == agent_id):
            current.bound_agent_id, current.bound_instance = agent_id, fingerprint
            current.bound_at = timezone.now()
            current.save(update_fields=["bound_agent_id", "bound_instance", "bound_at"])
            return
        if (current.bound_agent_id, current.bound_instance) == (agent_id, fingerprint):
            return
        seen = f"agent {agent_id[:60]}" + (f" from {address}" if address else "")
        current.conflict_at = timezone.now()
        current.conflict = f"{seen} presented this token, bound to agent {current.bound_agent_id}"[:300]
        current.save(update_fields=["conflict_at", "conflict"])
        record(
            actor=f"agent {agent_id[:60]}",
            action="agent_token.conflict",
            target=f"agent token kqa_{current.prefix} of pool {current.pool.name}",
            address=address,
            bound_to=current.bound_agent_id,
        )
        publish_event(
            tenant=tenant,
            kind="agent_token.conflict",
            data={"token_id": str(current.pk), "pool": current.pool.name, "agent_id": agent_id[:60]},
        )
    logger.warning(
        "agent token kqa_%s of pool %s, bound to agent %s, was presented by %s: refused",
        current.prefix,
        current.pool.name,
        current.bound_agent_id,
        seen,
    )
    raise AgentRejected(
        f"Agent token kqa_{current.prefix} is bound to agent {current.bound_agent_id}, which first used it; "
        "another agent (or a copy of the token) is refused. Give each agent a token of its own "
        f"(POST /api/v1/pools/{current.pool_id}/agent-tokens/); an agent that was reinstalled needs a new "
        "token, and the old one revoked."
    )


def _signature(schema_name: str, task_id: object, lease_id: object, purpose: str = "task-token") -> str:
    message = f"{purpose}:{schema_name}:{task_id}:{lease_id}".encode()
    digest = hmac.new(str(settings.SECRET_KEY).encode(), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def task_token(*, schema_name: str, task: Task) -> str:
    """A token that lets one run of one task report and upload outputs, from its compute nodes; it is
    good while that run is active (the lease it was dispatched under) and dies with it."""
    return f"{TASK_TOKEN_KIND}_{task.pk.hex}_{_signature(schema_name, task.pk, task.lease_id)}"


def session_key(*, schema_name: str, task: Task) -> str:
    """A run's key for the tenant's gateway (protocol.sessions): the same for the same run (an assignment
    sent again), another for the next; the gateway keeps only its hash, and it dies with the run."""
    signature = _signature(schema_name, task.pk, task.lease_id, purpose="gateway-session")
    return f"{sessions.KEY_KIND}_{task.pk.hex}_{signature}"


def task_authenticate(*, schema_name: str, presented: str, task_id: str) -> Task:
    """The task a task token is good for, locked, or AgentRejected saying why not."""
    parts = presented.split("_", 2)
    identifier = as_uuid(parts[1]) if len(parts) == 3 and parts[0] == TASK_TOKEN_KIND else None
    if identifier is None:
        raise AgentRejected("Malformed task token: expected kqt_<task>_<signature>, as the agent wrote it.")
    if str(identifier) != str(as_uuid(task_id)):
        raise AgentRejected("This task token is for another task.")
    task = Task.objects.select_for_update().filter(pk=identifier).first()
    if task is None or task.lease_id is None:
        raise AgentRejected("Unknown task token for this tenant.")
    if not hmac.compare_digest(parts[2], _signature(schema_name, task.pk, task.lease_id)):
        raise AgentRejected("This task token is not good for the task's current run.")
    if task.state not in (TaskState.DISPATCHING, TaskState.RUNNING):
        raise AgentRejected(f"Task {task.pk} is {task.state}; its token is no longer good.")
    return task
