"""The wallets: budgets in USD that pay for a user's or project's gateway calls and its GPU time and
storage alike, in one place for the gateway (before each call), the scheduling cycle (which holds back
tasks of a spent wallet) and metering (whose recorded costs reach the live counters through the
`cost_recorded` signal, connected in gateway.signals)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import Q, Sum
from redis.exceptions import RedisError

from apps.metering.selectors import compute_cost
from gateway.budgets import NANO_PER_USD, Exhausted, budget_key, period_end, period_start, usd
from gateway.budgets import Budget as Enforced
from gateway.cache import sync_redis
from gateway.models import Budget, Usage


def budget_label(budget: Budget) -> str:
    period = {"day": "daily ", "week": "weekly ", "month": "monthly ", "none": ""}[budget.period]
    kind = "wallet" if budget.period == Budget.Period.NONE else "budget"
    if budget.scope == Budget.Scope.PROJECT and budget.project is not None:
        return f"project {budget.project.name}'s {period}{kind}"
    if budget.scope == Budget.Scope.USER and budget.user is not None:
        return f"{budget.user.username}'s {period}{kind}"
    return f"the tenant's {period}{kind}"


def amount_text(unit: str, value: int) -> str:
    """An amount in a budget's unit as the API shows it: tokens, or USD from nano-USD."""
    return str(value) if unit == Budget.Unit.TOKENS else str(usd(value))


def enforced(budget: Budget) -> Enforced:
    limit = int(budget.limit) if budget.unit == Budget.Unit.TOKENS else int(budget.limit * NANO_PER_USD)
    return Enforced(
        id=str(budget.pk), label=budget_label(budget), unit=budget.unit, limit=limit, period=budget.period
    )


def ledger_spent(budget: Enforced, *, now: datetime, row: Budget | None = None) -> int:
    """What this budget spent in its current period, in its unit: the gateway's calls (its usage table,
    written as each call ends) and, for a budget in USD, the GPU time and storage the ledger metered for
    the same user, project or tenant. One wallet pays for both. `row`: the budget's row, where the caller
    has just read it."""
    if row is None:
        row = Budget.objects.filter(pk=budget.id).first()
    if row is None:
        return 0
    start = period_start(budget.period, now)
    # A wallet pays from when it was opened.
    since = datetime.combine(start, datetime.min.time(), tzinfo=UTC) if start is not None else row.created_at
    subject: dict[str, Any] = {}
    if row.scope == Budget.Scope.PROJECT:
        subject = {"project_id": row.project_id}
    elif row.scope == Budget.Scope.USER and row.user_id is not None:
        subject = {"user_id": row.user_id}
    totals = Usage.objects.filter(at__gte=since, **subject).aggregate(
        tokens_in=Sum("tokens_in"), tokens_out=Sum("tokens_out"), cost=Sum("cost_nano_usd")
    )
    if budget.unit == Budget.Unit.TOKENS:
        return int((totals["tokens_in"] or 0) + (totals["tokens_out"] or 0))
    return int(totals["cost"] or 0) + compute_cost(since=since, **subject)


@dataclass(frozen=True)
class Standing:
    """Where a budget stands this period, in its unit (tokens, or nano-USD): spent per the ledger, held by
    gateway calls in flight (None when the live counters cannot be read), and what is left."""

    spent: int
    held: int | None
    left: int
    resets: date | None  # the first day of the next period; None for a wallet


def standing(budget: Budget, *, now: datetime) -> Standing:
    rule = enforced(budget)
    spent = ledger_spent(rule, now=now, row=budget)
    held: int | None
    try:
        key = budget_key(getattr(connection, "schema_name", ""), rule, now)
        reserved = sync_redis().hget(key, "reserved")
        held = int(reserved or 0)
    except RedisError:
        held = None
    left = max(0, rule.limit - spent - (held or 0))
    return Standing(spent, held, left, period_end(budget.period, period_start(budget.period, now)))


def usd_budgets_for(*, user_id: str | None, project_id: str | None) -> list[Budget]:
    """The budgets in USD that a user's work in a project draws from: the tenant's, theirs, the project's."""
    scopes = Q(scope=Budget.Scope.TENANT)
    if user_id:
        scopes |= Q(scope=Budget.Scope.USER, user_id=user_id)
    if project_id:
        scopes |= Q(scope=Budget.Scope.PROJECT, project_id=project_id)
    return list(Budget.objects.select_related("project", "user").filter(scopes, unit=Budget.Unit.USD))


_CHARGE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HINCRBY', KEYS[1], 'spent', ARGV[1]) end
return -1
"""


def charge(*, user_id: str | None, project_id: str | None, cost_nano_usd: int, at: datetime) -> None:
    """Add metered GPU or storage cost to the live counters of the USD budgets it draws from, once the
    transaction that metered it commits (a counter not started yet will read it from the ledger)."""
    if cost_nano_usd <= 0:
        return
    schema = getattr(connection, "schema_name", "")
    keys = [
        budget_key(schema, enforced(budget), at)
        for budget in usd_budgets_for(user_id=user_id, project_id=project_id)
    ]

    def add() -> None:
        script = sync_redis().register_script(_CHARGE)
        for key in keys:
            script(keys=[key], args=[cost_nano_usd])

    if keys:
        transaction.on_commit(add)


@dataclass(frozen=True)
class Blocked:
    """Who may not start new GPU work because a budget in USD they draw from is spent."""

    tenant: str | None
    projects: dict[str, str]  # project id -> why
    users: dict[str, str]  # user id -> why

    def reason(self, *, user_id: str, project_id: str | None) -> str | None:
        return self.tenant or (self.projects.get(project_id or "")) or self.users.get(user_id)


def spent_budgets(*, now: datetime) -> Blocked:
    """The USD budgets that are used up (their ledger spend has reached their limit), for the scheduler:
    new tasks that draw from one wait, with the budget's sentence as their reason."""
    tenant, projects, users = None, {}, {}
    for budget in Budget.objects.select_related("project", "user").filter(unit=Budget.Unit.USD):
        rule = enforced(budget)
        spent = ledger_spent(rule, now=now, row=budget)
        if spent < rule.limit:
            continue
        why = Exhausted(rule, spent, 0).sentence()
        if budget.scope == Budget.Scope.TENANT:
            tenant = why
        elif budget.scope == Budget.Scope.PROJECT:
            projects[str(budget.project_id)] = why
        else:
            users[str(budget.user_id)] = why
    return Blocked(tenant, projects, users)
