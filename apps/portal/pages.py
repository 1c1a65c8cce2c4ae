"""More of the tenant portal: the queues and what each person may use, their tokens, their secrets and
their gateway usage. Each reads and writes through the same services, selectors and serializers as the
REST API, so a page never shows or allows what the API would not."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_POST

from apps.accounts import services as accounts
from apps.accounts.models import ApiToken, Role, User
from apps.accounts.selectors import service_account_list
from apps.accounts.serializers import TokenIn
from apps.configuration.apis import ComputeResourceOut
from apps.configuration.selectors import compute_resource_figures
from apps.core.errors import KliqueError
from apps.mcp import selectors as delegations
from apps.mcp.services import delegation_revoke
from apps.portal.views import admin_only, signed_in
from apps.scheduling import selectors
from apps.vault.selectors import secrets_visible_to
from apps.vault.services import secret_set
from gateway.apis import BudgetOut
from gateway.selectors import budgets_visible_to, usage_for


def _user(request: HttpRequest) -> User:
    user = request.user
    assert isinstance(user, User)
    return user


def _queues(user: User) -> list[dict[str, Any]]:
    data: Any = ComputeResourceOut(
        selectors.compute_resources(), many=True, context=compute_resource_figures(user)
    ).data
    return [dict(row) for row in data]


@signed_in
def queues(request: HttpRequest) -> HttpResponse:
    user = _user(request)
    access = selectors.policies_for(user)
    context = {
        "access": access,
        "has_objectives": any(row["objectives"] for row in access),
        "queues": _queues(user),
        "page": "queues",
    }
    return render(request, "portal/queues.html", context)


@signed_in
def queues_table(request: HttpRequest) -> HttpResponse:
    return render(request, "portal/_queues.html", {"queues": _queues(_user(request))})


def _tokens(user: User) -> Any:
    return ApiToken.objects.filter(user=user).order_by("-created_at")


@signed_in
def tokens(request: HttpRequest) -> HttpResponse:
    user = _user(request)
    return render(
        request,
        "portal/tokens.html",
        {"tokens": _tokens(user), "scopes": ApiToken.Scope.values, "page": "tokens"},
    )


@signed_in
@require_POST
def token_create(request: HttpRequest) -> HttpResponse:
    user = _user(request)
    context: dict[str, Any] = {}
    form = {key: value.strip() for key in ("name", "scope", "agent", "gpu_quota", "days")
            if (value := request.POST.get(key, "")).strip()}  # fmt: skip
    if "days" in form:
        form["expires_in_days"] = form.pop("days")
    form.setdefault("scope", ApiToken.Scope.READ)
    data = TokenIn(data=form)  # the API's own checks: an agent's name, a quota's GPUs, the days
    if not data.is_valid():
        context["error"] = " ".join(
            f"{field.replace('_', ' ').capitalize()}: {' '.join(str(item) for item in errors)}"
            for field, errors in data.errors.items()
        )
    else:
        fields = dict(data.validated_data)
        if "gpu_quota" in fields:
            fields["gpu_quota_units"] = fields.pop("gpu_quota")
        try:
            context["issued"] = accounts.token_create(
                tenant=request.tenant,  # type: ignore[attr-defined]
                user=user,
                **fields,
            )
        except KliqueError as error:
            context["error"] = error.message
    context["tokens"] = _tokens(user)
    return render(request, "portal/_token_made.html", context)


@signed_in
@require_POST
def token_revoke(request: HttpRequest, token_id: str) -> HttpResponse:
    user = _user(request)
    accounts.token_revoke(token=get_object_or_404(ApiToken, pk=token_id, user=user))
    return render(request, "portal/_token_made.html", {"tokens": _tokens(user), "revoked": True})


def _agents(user: User) -> list[dict[str, Any]]:
    return [
        delegation.view() for delegation in delegations.delegations(list(delegations.delegated_tokens(user)))
    ]


@signed_in
def agents(request: HttpRequest) -> HttpResponse:
    """The AI agents acting for the signed-in person: what each submitted, holds and spent; revoke one."""
    return render(request, "portal/agents.html", {"agents": _agents(_user(request)), "page": "agents"})


@signed_in
@require_POST
def agent_revoke(request: HttpRequest, token_id: str) -> HttpResponse:
    user = _user(request)
    token = get_object_or_404(delegations.delegated_tokens(user), pk=token_id)
    cancelled = delegation_revoke(
        tenant=request.tenant,  # type: ignore[attr-defined]
        user=user,
        token=token,
        cancel_tasks=request.POST.get("cancel_tasks") == "on",
    )
    done = f"Revoked agent {token.agent}" + (
        f" and cancelled {cancelled} of its tasks." if cancelled else "."
    )
    return render(request, "portal/_agents.html", {"agents": _agents(user), "done": done})


def _service_accounts() -> Any:
    return service_account_list().prefetch_related("api_tokens").order_by("username")


@admin_only
def service_accounts(request: HttpRequest) -> HttpResponse:
    return render(
        request, "portal/service_accounts.html", {"accounts": _service_accounts(), "page": "service-accounts"}
    )


@admin_only
@require_POST
def service_account_create(request: HttpRequest) -> HttpResponse:
    """Create a service account (admins) with its first token, shown once."""

    context: dict[str, Any] = {}
    try:
        tenant = request.tenant  # type: ignore[attr-defined]
        account = accounts.service_account_create(
            tenant=tenant,
            name=request.POST.get("name", "").strip(),
            role=request.POST.get("role", Role.MEMBER),
            description=request.POST.get("description", "").strip(),
        )
        context["issued"] = accounts.token_create(
            tenant=tenant, user=account, name="first", scope=ApiToken.Scope.SUBMIT
        )
        context["account"] = account
    except KliqueError as error:
        context["error"] = error.message
    context["accounts"] = _service_accounts()
    return render(request, "portal/_service_account_made.html", context)


@signed_in
def secrets(request: HttpRequest) -> HttpResponse:
    user = _user(request)
    context = {"secrets": secrets_visible_to(user), "admin": user.has_role(Role.ADMIN), "page": "secrets"}
    return render(request, "portal/secrets.html", context)


@signed_in
@require_POST
def secret_keep(request: HttpRequest) -> HttpResponse:
    """Keep a secret (write-only): its value is never shown again, here or anywhere."""

    user = _user(request)
    context: dict[str, Any] = {}
    try:
        secret = secret_set(
            user=user,
            scope=request.POST.get("scope", "user"),
            name=request.POST.get("name", "").strip(),
            value=request.POST.get("value", ""),
        )
        context["message"] = f"Kept {secret.name} ({secret.scope}); its value cannot be read back."
    except KliqueError as error:
        context["error"] = error.message
    context["secrets"] = secrets_visible_to(user)
    return render(request, "portal/_secrets.html", context)


@signed_in
def usage(request: HttpRequest) -> HttpResponse:
    """The person's gateway calls and the budgets that apply to them."""

    user = _user(request)
    context = {
        "calls": usage_for(user).filter(user_id=user.pk)[:50],
        "budgets": BudgetOut(budgets_visible_to(user), many=True).data,
        "page": "usage",
    }
    return render(request, "portal/usage.html", context)
