"""The gateway's Django side: its configuration and budgets (through the API), and what the hot path loads
when its cache is cold: who a token is, which budgets apply to it, what the ledger says was spent."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import F, QuerySet, Sum
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import ApiToken, Group, Project, ProjectMembership, Role, User
from apps.accounts.services import TokenRejected, token_authenticate
from apps.audit.services import record
from apps.core import outbound
from apps.core.errors import InvalidInput
from apps.core.ids import as_uuid
from apps.metering.ledger import Event, Report, ingest
from apps.metering.models import Kind, LedgerEvent, Rejection
from apps.vault.models import Secret
from apps.vault.services import tenant_secret
from gateway import config as gateway_config
from gateway import selectors
from gateway.budgets import Budget as Enforced
from gateway.config import Deployment
from gateway.models import Budget, GatewaySettings, SelfHosted, Session, Usage
from gateway.signals import selfhosted_wanted
from gateway.upstream import litellm_providers
from gateway.wallets import enforced, ledger_spent
from protocol import sessions
from tenants.models import Tenant
from tenants.selectors import tenant_for_host

GATEWAY_READER = "the LLM gateway"


# --- configuration ---------------------------------------------------------------------------------


@transaction.atomic
def settings_save(*, user: User, document: Any) -> GatewaySettings:
    """Check a configuration document whole (every problem listed) and make it the tenant's."""
    try:
        parsed = gateway_config.parse(document)
    except gateway_config.ConfigInvalid as invalid:
        raise InvalidInput("; ".join(invalid.errors), field="document") from None
    known = set(Secret.objects.filter(scope=Secret.Scope.TENANT).values_list("name", flat=True))
    missing = sorted(parsed.secret_names() - known)
    if missing:
        raise InvalidInput(
            f"No tenant secret named {', '.join(missing)}: keep each deployment's key with "
            "POST /api/v1/secrets/ (scope tenant) before naming it in api_key_secret.",
            field="document",
        )
    for deployment in parsed.deployments:
        if not deployment.openai_compatible:
            _check_provider(deployment.provider, deployment.model_name)
    refused = [
        f"{deployment.id}: {why}"
        for deployment in parsed.deployments
        if (why := _address_refused(deployment))
    ]
    if refused:
        raise InvalidInput("; ".join(refused), field="document")
    row, _ = GatewaySettings.objects.update_or_create(
        pk=1, defaults={"document": document, "updated_by": user}
    )
    return row


def _check_provider(provider: str, model_name: str) -> None:
    """Providers other than OpenAI-compatible ones go through LiteLLM: it must know them (imported here,
    when such a configuration is saved, never at start-up)."""

    if provider not in litellm_providers():
        raise InvalidInput(
            f"model {model_name!r}: LiteLLM knows no provider {provider!r}; use one of its providers, or "
            "'openai/<model>' with api_base for any OpenAI-compatible server (vLLM, SGLang, llama.cpp).",
            field="document",
        )


def upstream_key_names() -> set[str]:
    """The vault secrets the tenant's gateway configuration names as upstream keys: the platform's own,
    never given to a task (apps.vault.services.register_platform_names)."""
    document = selectors.settings_get().document
    models = document.get("model_list", []) if isinstance(document, dict) else []
    return {
        str(model["litellm_params"]["api_key_secret"])
        for model in models
        if isinstance(model, dict)
        and isinstance(model.get("litellm_params"), dict)
        and model["litellm_params"].get("api_key_secret")
    }


def _address_refused(deployment: gateway_config.Deployment) -> str | None:
    """Why a deployment's api_base may not be called, as far as its name resolves now (one that does not
    resolve yet is checked again at every call: apps.core.outbound)."""
    if not deployment.api_base:
        return None
    try:
        outbound.check_url(deployment.api_base)
    except outbound.OutboundRefused as refused:
        return None if refused.unresolved else str(refused)
    return None


def deployment_keys(config: gateway_config.GatewayConfig) -> dict[str, str]:
    """The vault secrets the deployments name, decrypted for the gateway process (each read audited)."""

    return {name: tenant_secret(name, reader=GATEWAY_READER) for name in sorted(config.secret_names())}


# --- budgets ----------------------------------------------------------------------------------------


def _subject_project(reference: str | None) -> Project:
    identifier = as_uuid(reference or "")
    project = (
        Project.objects.filter(pk=identifier).first() if identifier else None
    ) or Project.objects.filter(name=reference or "").first()
    if project is None:
        raise InvalidInput(f"No project {reference!r} in this tenant.", field="project")
    return project


def _subject_user(reference: str | None) -> User:
    identifier = as_uuid(reference or "")
    user = (User.objects.filter(pk=identifier).first() if identifier else None) or User.objects.filter(
        username=reference or ""
    ).first()
    if user is None:
        raise InvalidInput(f"No user {reference!r} in this tenant.", field="user")
    return user


@transaction.atomic
def budget_create(
    *,
    scope: str,
    unit: str,
    limit: Decimal | int | str,
    period: str,
    project: str | None = None,
    user: str | None = None,
) -> Budget:
    limit = Decimal(str(limit))
    if limit < 0:
        raise InvalidInput("A budget's limit cannot be negative.", field="limit")
    if unit == Budget.Unit.TOKENS and limit != limit.to_integral_value():
        raise InvalidInput("A budget in tokens counts whole tokens.", field="limit")
    budget = Budget(scope=scope, unit=unit, limit=limit, period=period)
    if scope == Budget.Scope.PROJECT:
        budget.project = _subject_project(project)
    elif scope == Budget.Scope.USER:
        budget.user = _subject_user(user)
    elif project or user:
        raise InvalidInput("A tenant budget names no project or user.", field="scope")
    if Budget.objects.filter(
        scope=scope, project=budget.project, user=budget.user, unit=unit, period=period
    ).exists():
        raise InvalidInput(
            f"This {scope} already has a {period} budget in {unit}; change that one instead.", field="scope"
        )
    budget.save()
    return budget


@transaction.atomic
def budget_update(*, budget: Budget, limit: Decimal | int | str) -> Budget:
    limit = Decimal(str(limit))
    if limit < 0:
        raise InvalidInput("A budget's limit cannot be negative.", field="limit")
    budget.limit = limit
    budget.save(update_fields=["limit"])
    return budget


@transaction.atomic
def budget_top_up(*, budget: Budget, amount: Decimal | int | str) -> Budget:
    """Add to a wallet (a budget with period none)."""
    amount = Decimal(str(amount))
    if budget.period != Budget.Period.NONE:
        raise InvalidInput(
            f"Only wallets (period none) are topped up; this budget resets every {budget.period}: "
            "change its limit instead.",
            field="amount",
        )
    if amount <= 0:
        raise InvalidInput("A top-up adds a positive amount.", field="amount")
    Budget.objects.filter(pk=budget.pk).update(limit=F("limit") + amount)
    budget.refresh_from_db()
    budget.save(update_fields=["limit"])  # through save(), so every gateway process hears of it
    return budget


# --- who calls ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """Who a gateway call is from, as the hot path caches it (until the tenant's epoch moves)."""

    schema: str
    tenant_slug: str
    user_id: str
    username: str
    role: str  # the lesser of the user's role and the token's scope
    token_prefix: str
    agent: str
    expires_at: datetime
    project_id: str | None
    project_name: str
    budgets: tuple[Enforced, ...]


class CallerRefused(Exception):
    def __init__(self, message: str, status: int, kind: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code


def _effective_role(user: User, token: ApiToken) -> str:
    if token.scope == ApiToken.Scope.READ:
        return Role.VIEWER
    if token.scope == ApiToken.Scope.SUBMIT and user.role == Role.ADMIN:
        return Role.MEMBER
    return str(user.role)


def _project_for(user: User, reference: str) -> Project | None:
    memberships = ProjectMembership.objects.filter(user=user).select_related("project")
    if reference:
        identifier = as_uuid(reference)
        for membership in memberships:
            if membership.project.name == reference or membership.project.pk == identifier:
                return membership.project
        if user.role == Role.ADMIN:
            project = Project.objects.filter(name=reference).first() or (
                Project.objects.filter(pk=identifier).first() if identifier else None
            )
            if project is not None:
                return project
        raise CallerRefused(
            f"{user.username} is not a member of project {reference!r}; ask its admin to add you, or call "
            "without a project.",
            403,
            "permission_error",
            "not_a_project_member",
        )
    projects = [membership.project for membership in memberships]
    if len(projects) == 1:
        return projects[0]
    budgeted = sorted(
        {str(name) for name in Budget.objects.filter(scope=Budget.Scope.PROJECT, project__in=projects)
         .values_list("project__name", flat=True)}
    )  # fmt: skip
    if budgeted:  # calling without a project would pass by the budgets of the projects the caller is in
        names = ", ".join(sorted(project.name for project in projects))
        raise CallerRefused(
            f"{user.username} is a member of several projects ({names}) and project budgets apply "
            f"({', '.join(budgeted)}): name the project that pays with the OpenAI-Project header "
            "(project= in OpenAI's client).",
            400,
            "invalid_request_error",
            "project_required",
        )
    return None


def caller_load(*, host: str, presented: str, project: str) -> Caller:
    """Who `presented` is at `host`, with the budgets that apply (runs in a thread, off the event loop)."""

    tenant = tenant_for_host(host)
    if tenant is None:
        raise CallerRefused(
            f"No tenant is served at {host!r}; check the address.", 404, "invalid_request_error", "no_tenant"
        )
    if tenant.is_suspended:
        raise CallerRefused(
            f"Tenant {tenant.slug} is suspended: {tenant.suspended_reason}",
            403,
            "permission_error",
            "tenant_suspended",
        )
    with schema_context(tenant.schema_name):
        if presented.startswith(f"{sessions.KEY_KIND}_"):
            return _session_caller(tenant, presented)
        try:
            user, token = token_authenticate(tenant=tenant, presented=presented)
        except TokenRejected as rejected:
            raise CallerRefused(str(rejected), 401, "invalid_request_error", "invalid_api_key") from None
        chosen = _project_for(user, project)
        return Caller(
            schema=tenant.schema_name,
            tenant_slug=tenant.slug,
            user_id=str(user.pk),
            username=user.username,
            role=_effective_role(user, token),
            token_prefix=token.prefix,
            agent=token.agent,
            expires_at=token.expires_at,
            project_id=str(chosen.pk) if chosen else None,
            project_name=chosen.name if chosen else "",
            budgets=tuple(enforced(budget) for budget in _budgets_of(user, chosen)),
        )


def _session_caller(tenant: Tenant, presented: str) -> Caller:
    """The caller a run's session key names: the task's user, never above a member, in the task's
    project, with the session's own quota beside the user's budgets."""
    parts = presented.split("_", 2)
    task_id = as_uuid(parts[1]) if len(parts) == 3 else None
    row = (
        Session.objects.select_related("user", "project").filter(task_id=task_id).first() if task_id else None
    )
    digest = hashlib.sha256(presented.encode()).hexdigest()
    if row is None or not hmac.compare_digest(row.key_hash, digest) or not row.user.is_active:
        raise CallerRefused(
            "This session key is not good (any more): a run's key dies when the run ends.",
            401,
            "invalid_request_error",
            "invalid_api_key",
        )
    role = Role.VIEWER if row.user.role == Role.VIEWER else Role.MEMBER
    return Caller(
        schema=tenant.schema_name,
        tenant_slug=tenant.slug,
        user_id=str(row.user_id),
        username=row.user.username,
        role=str(role),
        token_prefix=session_prefix(row.task_id),
        agent=row.label,
        expires_at=datetime.max.replace(tzinfo=UTC),  # until the session closes (the epoch moves)
        project_id=str(row.project_id) if row.project_id else None,
        project_name=row.project.name if row.project else "",
        budgets=(
            *(enforced(budget) for budget in _budgets_of(row.user, row.project)),
            Enforced(
                id=f"{SESSION_BUDGET}{row.task_id}",
                label=f"{row.label}'s quota",
                unit=Budget.Unit.TOKENS,
                limit=row.tokens,
                period=Budget.Period.NONE,
            ),
        ),
    )


def _budgets_of(user: User, project: Project | None) -> QuerySet[Budget]:
    budgets = Budget.objects.select_related("project", "user").filter(scope=Budget.Scope.TENANT)
    budgets |= Budget.objects.select_related("project", "user").filter(scope=Budget.Scope.USER, user=user)
    if project is not None:
        budgets |= Budget.objects.select_related("project", "user").filter(
            scope=Budget.Scope.PROJECT, project=project
        )
    return budgets.order_by("scope", "created_at")


# --- a run's gateway session (protocol.sessions; apps.fleet opens and closes them) ----------------------

SESSION_BUDGET = "session:"  # the id of a session's quota among a caller's budgets


def session_prefix(task_id: Any) -> str:
    """What a session's calls are recorded under (the usage rows' token_prefix)."""
    return f"{sessions.KEY_KIND}{uuid.UUID(str(task_id)).hex[:12]}"


def session_open(
    *, task_id: Any, key: str, user: User, project: Project | None, label: str, tokens: int
) -> None:
    """Register a run's key (again for the same run: nothing changes; for a new run: its key replaces
    the last one's)."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    if Session.objects.filter(task_id=task_id, key_hash=digest).exists():
        return
    Session.objects.update_or_create(
        task_id=task_id,
        defaults={
            "key_hash": digest,
            "user": user,
            "project": project,
            "label": label[:100],
            "tokens": tokens,
            "opened_at": timezone.now(),
        },
    )


def session_close(task_id: Any) -> None:
    """The run is over: its key is dead (the gateway's caches drop it as the epoch moves)."""
    for row in Session.objects.filter(task_id=task_id):
        row.delete()


def session_spent(task_id: str) -> int:
    """The tokens a session's key spent since it opened."""
    row = Session.objects.filter(task_id=task_id).first()
    if row is None:
        return 0
    totals = Usage.objects.filter(token_prefix=session_prefix(task_id), at__gte=row.opened_at).aggregate(
        tokens_in=Sum("tokens_in"), tokens_out=Sum("tokens_out")
    )
    return int((totals["tokens_in"] or 0) + (totals["tokens_out"] or 0))


def config_load(schema: str) -> tuple[gateway_config.GatewayConfig, dict[str, str], str]:
    """The tenant's parsed configuration with the models its apps serve, its deployments' keys, and a
    version that changes with them."""
    with schema_context(schema):
        row = selectors.settings_get()
        parsed = gateway_config.parse(row.document) if row.document else gateway_config.EMPTY
        keys = deployment_keys(parsed)
        served = selfhosted_deployments(parsed, schema)
        version = row.updated_at.isoformat() if row.updated_at else ""
        if served:
            digest = hashlib.sha256(repr(sorted(served, key=lambda d: d.id)).encode()).hexdigest()[:16]
            version = f"{version}+{digest}"
        return parsed.with_deployments(served), keys, version


# --- models the tenant's apps serve (apps.catalogue registers them) -------------------------------------

SELFHOSTED_TIMEOUT = 600.0  # seconds the gateway waits for a self-hosted model's answer (or its next chunk)


def selfhosted_api_base(schema: str, app_id: str) -> str:
    """The address gateway.selfhosted reads a call's app from: never resolved, only its path is used."""
    return f"{SELFHOSTED_BASE}/{schema}/{app_id}/v1"


SELFHOSTED_BASE = "http://selfhosted.klique.invalid"


def selfhosted_deployments(config: gateway_config.GatewayConfig, schema: str) -> tuple[Deployment, ...]:
    """The registered self-hosted models as deployments, each for the people its app is shared with.

    A group an administrator configured is joined only by apps a tenant admin owns, and a group of apps
    alone belongs to the owner who registered it first: nobody's calls reach a server they did not mean to
    call (a model's server reads every prompt sent to it)."""
    rows = list(SelfHosted.objects.select_related("owner").order_by("created_at"))
    if not rows:
        return ()
    configured = set(config.model_names)
    modes = {d.model_name: d.mode for d in config.deployments}
    first_owner: dict[str, Any] = {}
    kept = []
    for row in rows:
        if row.model_name in configured:
            if row.owner.role != Role.ADMIN or modes.get(row.model_name) != row.mode:
                continue
        elif first_owner.setdefault(row.model_name, row.owner_id) != row.owner_id:
            continue
        kept.append(row)
    projects = {row.project_id for row in kept if row.project_id}
    groups = {str(group) for row in kept for group in row.group_ids}
    in_project: dict[Any, set[str]] = {}
    for project_id, user_id in ProjectMembership.objects.filter(project_id__in=projects).values_list(
        "project_id", "user_id"
    ):
        in_project.setdefault(project_id, set()).add(str(user_id))
    in_group: dict[str, set[str]] = {}
    for group_id, user_id in Group.members.through.objects.filter(group_id__in=groups).values_list(
        "group_id", "user_id"
    ):
        in_group.setdefault(str(group_id), set()).add(str(user_id))
    return tuple(
        Deployment(
            id=f"{row.model_name}#app-{row.app_id}",
            model_name=row.model_name,
            provider="openai",
            model=row.served_model,
            api_base=selfhosted_api_base(schema, str(row.app_id)),
            api_key_secret="",
            weight=1.0,
            timeout=SELFHOSTED_TIMEOUT,
            mode=row.mode,
            max_output_tokens=gateway_config.DEFAULT_MAX_OUTPUT,
            input_cost_per_million=row.input_cost_per_million,
            output_cost_per_million=row.output_cost_per_million,
            app=str(row.app_id),
            audience=frozenset(
                {
                    str(row.owner_id),
                    *in_project.get(row.project_id, ()),
                    *(user for group in row.group_ids for user in in_group.get(str(group), ())),
                }
            ),
        )
        for row in kept
    )


def selfhosted_refusal(*, owner: User, model_name: str, mode: str, app_id: Any = None) -> str | None:
    """Why an app of `owner` may not serve `model_name` through the gateway, if it may not."""
    config = gateway_config.parse(selectors.settings_get().document or {})
    configured = config.group(model_name)
    if configured and owner.role != Role.ADMIN:
        return (
            f"{model_name!r} is a model the tenant's gateway configures; only a tenant admin's app may "
            "serve it too. Give the model another name."
        )
    if configured and configured[0].mode != mode:
        return f"{model_name!r} is a {configured[0].mode} model in the gateway; this app serves {mode}."
    taken = SelfHosted.objects.filter(model_name=model_name).exclude(owner=owner).exclude(app_id=app_id)
    if not configured and taken.exists():
        return f"Another person's app serves {model_name!r} through the gateway; give the model another name."
    return None


@transaction.atomic
def selfhosted_register(
    *,
    app_id: Any,
    task_id: Any,
    label: str,
    owner: User,
    model_name: str,
    mode: str,
    served_model: str = "",
    input_cost_per_million: float = 0.0,
    output_cost_per_million: float = 0.0,
    project: Project | None = None,
    group_ids: list[str] | None = None,
    startup_seconds: int = 300,
) -> SelfHosted:
    """Register (or register again) the model an app serves; InvalidInput where it may not serve it."""
    if why := selfhosted_refusal(owner=owner, model_name=model_name, mode=mode, app_id=app_id):
        raise InvalidInput(why, field="variables")
    row, _ = SelfHosted.objects.update_or_create(
        app_id=app_id,
        defaults={
            "task_id": task_id,
            "label": label[:100],
            "owner": owner,
            "model_name": model_name,
            "served_model": served_model or model_name,
            "mode": mode,
            "input_cost_per_million": Decimal(str(input_cost_per_million)),
            "output_cost_per_million": Decimal(str(output_cost_per_million)),
            "project": project,
            "group_ids": [str(group) for group in group_ids or []],
            "state": SelfHosted.State.STARTING,
            "channel": "",
            "startup_seconds": startup_seconds,
        },
    )
    return row


def selfhosted_set(app_id: Any, *, state: str | None = None, channel: str | None = None) -> None:
    """The app's state or tunnel changed (no deployment does: the epoch stays)."""
    changes: dict[str, Any] = {}
    if state is not None:
        changes["state"] = state
    if channel is not None:
        changes["channel"] = channel
    SelfHosted.objects.filter(app_id=app_id).update(**changes)


def selfhosted_tunnel_gone(app_id: Any, channel: str, *, schema: str | None = None) -> None:
    """The tunnel on `channel` is gone (a newer one stays); in `schema` where the caller is not in it."""
    with schema_context(schema) if schema else contextlib.nullcontext():
        SelfHosted.objects.filter(app_id=app_id, channel=channel).update(channel="")


def selfhosted_remove(app_id: Any) -> None:
    """The app no longer serves its model: it leaves the gateway."""
    SelfHosted.objects.filter(app_id=app_id).delete()


def selfhosted_ended(task_id: Any) -> None:
    """An app's task ended: the model it served leaves the gateway, unless the app sleeps (stopped for
    idleness, to start again at the next call). Only the app's own current task counts: a task's spec is
    its submitter's to write."""
    for row in SelfHosted.objects.filter(task_id=task_id).exclude(state=SelfHosted.State.ASLEEP):
        row.delete()  # one by one: each delete moves the tenant's epoch (gateway.signals)


def selfhosted_asleep(app_id: Any) -> bool:
    return SelfHosted.objects.filter(app_id=app_id, state=SelfHosted.State.ASLEEP).exists()


def selfhosted_last_call(app_id: Any) -> datetime | None:
    return SelfHosted.objects.filter(app_id=app_id).values_list("last_call_at", flat=True).first()


@dataclass(frozen=True)
class Serving:
    """What the gateway needs to reach a self-hosted model now."""

    label: str
    state: str
    channel: str
    startup_seconds: int


def selfhosted_serving(schema: str, app_id: str, *, called: bool = False) -> Serving | None:
    """The app's tunnel (none while it starts or sleeps); `called`: a call reached it (for idleness)."""
    with schema_context(schema):
        if called:
            SelfHosted.objects.filter(app_id=app_id).update(last_call_at=timezone.now())
        row = SelfHosted.objects.filter(app_id=app_id).first()
        return None if row is None else Serving(row.label, row.state, row.channel, row.startup_seconds)


def selfhosted_wake(schema: str, app_id: str) -> None:
    """A call wants a model whose app is not running: its app starts again, if it scales to zero
    (apps.catalogue answers the signal)."""
    with schema_context(schema):
        tenant = Tenant.objects.filter(schema_name=schema).first()
        if tenant is not None and SelfHosted.objects.filter(app_id=app_id, channel="").exists():
            selfhosted_wanted.send(sender=SelfHosted, tenant=tenant, app_id=app_id)


def ledger_spent_in(schema: str, budget: Enforced, now: datetime) -> int:
    with schema_context(schema):
        if budget.id.startswith(SESSION_BUDGET):
            return session_spent(budget.id.removeprefix(SESSION_BUDGET))
        return ledger_spent(budget, now=now)


def audit(schema: str, **event: str) -> None:
    """Record a refusal in the tenant's audit log (the gateway has no Django request to hang it on)."""

    with schema_context(schema):
        reason = event.pop("reason", "")
        record(**event, reason=reason)


def _unmetered() -> QuerySet[Usage]:
    return (
        Usage.objects.exclude(status=Usage.Status.FAILED)
        .exclude(request_id__in=LedgerEvent.objects.filter(kind=Kind.TOKENS).values("event_id"))
        .exclude(request_id__in=Rejection.objects.values("event_id"))
    )


def calls_to_meter() -> bool:
    """Whether some gateway call is not in the ledger yet (periodic work due)."""
    return _unmetered().exists()


def meter_calls() -> Report:
    """Move the gateway's calls into the ledger (each call's request id is its event id), up to
    5,000 a run; the ones already there, or refused before, are skipped."""

    pending = _unmetered().order_by("at")[:5000]
    events = [
        Event(
            event_id=row.request_id,
            kind=Kind.TOKENS,
            started_at=row.at,
            user=str(row.user_id),
            project=str(row.project_id) if row.project_id else "",
            model=row.model,
            tokens_in=row.tokens_in,
            tokens_out=row.tokens_out,
            cost_nano_usd=row.cost_nano_usd,
            source="gateway",
        )
        for row in pending
    ]
    return ingest(events) if events else Report()
