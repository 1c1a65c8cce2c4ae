"""Revoking an AI agent's delegated token, and with it, if asked, the work it left queued or running."""

from __future__ import annotations

from django.db import transaction

from apps.accounts.models import ApiToken, User
from apps.accounts.services import token_revoke
from apps.audit.services import record
from apps.core.errors import InvalidInput
from apps.scheduling.models import ENDED_STATES, Task
from apps.scheduling.services import task_cancel
from tenants.models import Tenant


@transaction.atomic
def delegation_revoke(*, tenant: Tenant, user: User, token: ApiToken, cancel_tasks: bool = False) -> int:
    """Revoke `token` at once and, with `cancel_tasks`, cancel its unfinished tasks; returns how many were
    cancelled. Every process reads the token on each request (the gateway's cache is fenced by the
    tenant's epoch, bumped when the token changes), so its next MCP, REST or gateway call is refused."""
    token_revoke(token=token)
    cancelled = 0
    if cancel_tasks:
        for task in Task.objects.filter(submitted_with=token).exclude(state__in=ENDED_STATES):
            try:
                with transaction.atomic():  # one that ended meanwhile has nothing to cancel
                    task_cancel(tenant=tenant, user=user, task=task)
            except InvalidInput:
                continue
            cancelled += 1
    record(
        actor=user.username,
        action="delegation.revoke",
        target=f"token {token.prefix}",
        agent=token.agent,
        cancelled_tasks=cancelled,
    )
    return cancelled
