"""The AI agents acting for a user: each delegated token (an ApiToken with an agent's name) with what it
submitted, what it holds now and what it spent, read from the ledger.

A ledger event names the user it is billed to, not the token that caused it, so the token's share is
found through what the token made: its GPU time is the ledger's `gpu:<task id>:` segments of the tasks it
submitted (Task.submitted_with), its gateway tokens the ledger's events of the calls it made (the
gateway's usage rows keep each call's token prefix; a call's request id is its ledger event id). Both are
read through the ledger's (user, started_at) index, from when the token was made.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import CharField, Count, F, Func, OuterRef, QuerySet, Subquery, Sum, Value

from apps.accounts.models import ApiToken, Role, User
from apps.metering.models import Kind, LedgerEvent
from apps.metering.selectors import gpu_hours_text, usd_text
from apps.scheduling.engine import to_gpus_text
from apps.scheduling.models import ENDED_STATES, Task
from gateway.models import Usage


@dataclass
class Delegation:
    """One agent identity acting for a user, and its footprint."""

    token: ApiToken
    submitted: int = 0
    unfinished: int = 0
    holding_units: int = 0
    gpu_unit_ms: int = 0
    gpu_cost_nano: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    token_cost_nano: int = 0
    calls: int = 0

    @property
    def active(self) -> bool:
        return self.token.is_active

    def view(self) -> dict[str, Any]:
        token = self.token
        return {
            "id": str(token.pk),
            "name": token.name,
            "agent": token.agent,
            "user": token.user.username,
            "token": f"klq_{token.prefix}_…",
            "scope": token.scope,
            "gpu_quota": None if token.gpu_quota_units is None else to_gpus_text(token.gpu_quota_units),
            "active": self.active,
            "created_at": _iso(token.created_at),
            "expires_at": _iso(token.expires_at),
            "revoked_at": _iso(token.revoked_at),
            "last_used_at": _iso(token.last_used_at),
            "tasks_submitted": self.submitted,
            "tasks_unfinished": self.unfinished,
            "holds_gpus": to_gpus_text(self.holding_units),
            "gpu_hours": gpu_hours_text(self.gpu_unit_ms),
            "gateway_calls": self.calls,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "cost_usd": usd_text(self.gpu_cost_nano + self.token_cost_nano),
        }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def delegated_tokens(user: User, *, everyone: bool = False) -> QuerySet[ApiToken]:
    """The delegated tokens acting for `user`, newest first, revoked ones included (their record stays);
    with `everyone`, a tenant admin's view of every person's (so an admin can stop anyone's agent)."""
    tokens = ApiToken.objects.select_related("user").exclude(agent="").order_by("-created_at")
    return tokens if everyone and user.has_role(Role.ADMIN) else tokens.filter(user=user)


def delegations(tokens: list[ApiToken]) -> list[Delegation]:
    """Each of these agent identities with what it submitted, holds now and spent."""
    if not tokens:
        return []
    users = {token.user_id for token in tokens}
    rows = {token.pk: Delegation(token) for token in tokens}
    since = min(token.created_at for token in tokens)

    made_by: dict[str, Any] = {}  # task id -> the token that submitted it
    tasks = Task.objects.filter(submitted_with__in=rows)
    for pk, token_pk, state, units in tasks.values_list("pk", "submitted_with", "state", "size_units"):
        delegation = rows[token_pk]
        delegation.submitted += 1
        if state not in ENDED_STATES:
            delegation.unfinished += 1
            delegation.holding_units += units
        made_by[str(pk)] = token_pk

    if made_by:
        segments = (
            LedgerEvent.objects.filter(kind=Kind.GPU, user_id__in=users, started_at__gte=since)
            .annotate(
                task=Func(
                    F("event_id"), Value(":"), Value(2), function="split_part", output_field=CharField()
                )
            )
            .filter(task__in=list(made_by))
            .values("task")
            .annotate(unit_ms=Sum("gpu_unit_ms"), cost=Sum("cost_nano_usd"))
        )
        for segment in segments:
            delegation = rows[made_by[segment["task"]]]
            delegation.gpu_unit_ms += int(segment["unit_ms"] or 0)
            delegation.gpu_cost_nano += int(segment["cost"] or 0)

    by_prefix = {token.prefix: rows[token.pk] for token in tokens}
    calls = Usage.objects.filter(token_prefix__in=by_prefix, user_id__in=users, at__gte=since)
    metered = (
        LedgerEvent.objects.filter(kind=Kind.TOKENS, user_id__in=users, started_at__gte=since)
        .filter(event_id__in=calls.values("request_id"))
        .annotate(
            prefix=Subquery(Usage.objects.filter(request_id=OuterRef("event_id")).values("token_prefix")[:1])
        )
        .values("prefix")
        .annotate(
            calls=Count("pk"),
            tokens_in=Sum("tokens_in"),
            tokens_out=Sum("tokens_out"),
            cost=Sum("cost_nano_usd"),
        )
    )
    for made in metered:
        delegation = by_prefix[made["prefix"]]
        delegation.calls = int(made["calls"])
        delegation.tokens_in, delegation.tokens_out = (
            int(made["tokens_in"] or 0),
            int(made["tokens_out"] or 0),
        )
        delegation.token_cost_nano = int(made["cost"] or 0)
    return list(rows.values())
