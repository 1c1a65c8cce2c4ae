"""The Platform Management Center: the provider's pages at the base domain (public schema). Its admins
see every tenant with its share, usage and cost over time, create tenants and suspend or resume them.
Tenants' people have no account here, so their sessions never open it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib import auth
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from apps.accounts.models import Role, User
from apps.accounts.services import SignInLimited, sign_in_check, sign_in_failed, sign_in_succeeded
from apps.audit.services import record
from apps.catalogue import selectors as catalogue
from apps.core.errors import KliqueError
from apps.provider import services as tenancy
from apps.provider.selectors import usage_by_tenant
from apps.scheduling.engine import UNITS_PER_GPU
from tenants.models import Tenant
from tenants.selectors import tenant_list

View = Callable[..., HttpResponse]
DAYS = 30


def provider_admin(view: View) -> View:
    @wraps(view)
    def check(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        user = request.user
        if not isinstance(user, User) or not user.has_role(Role.ADMIN):
            return HttpResponseRedirect("/portal/sign-in/")
        return view(request, *args, **kwargs)

    return check


@require_http_methods(["GET", "POST"])
def sign_in(request: HttpRequest) -> HttpResponse:
    context: dict[str, Any] = {"passwords": True, "provider": True, "next": "/portal/"}
    if request.method == "POST":
        username = request.POST.get("username", "")
        try:
            sign_in_check(request=request, username=username, where="provider sign-in")
        except SignInLimited as limited:
            context["error"] = str(limited)
            return render(request, "portal/sign_in.html", context, status=429)
        user = auth.authenticate(request, username=username, password=request.POST.get("password", ""))
        if not isinstance(user, User) or not user.has_role(Role.ADMIN):
            sign_in_failed(request=request, username=username)
            record(actor=username[:150] or "?", action="password.refused", target="provider sign-in")
            context["error"] = "Wrong username or password, or not one of the provider's admins."
            return render(request, "portal/sign_in.html", context, status=401)
        sign_in_succeeded(username=user.username)
        auth.login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        record(actor=user.username, action="password.signed_in", target="provider session")
        return HttpResponseRedirect("/portal/")
    return render(request, "portal/sign_in.html", context)


def _tenants() -> list[dict[str, Any]]:
    since = timezone.now().date() - timedelta(days=DAYS)
    usage: dict[str, dict[str, float]] = defaultdict(lambda: {"gpu_hours": 0.0, "cost": 0.0})
    for row in usage_by_tenant(since=since):
        usage[row["tenant"]]["gpu_hours"] += float(row["gpu_hours"])
        usage[row["tenant"]]["cost"] += float(row["cost_usd"])
    tenants = list(tenant_list().order_by("slug"))
    apps = catalogue.apps_by_tenant(tenants)
    return [
        {
            "slug": tenant.slug,
            "name": tenant.name,
            "status": tenant.status,
            "reason": tenant.suspended_reason,
            "share": tenant.gpu_share,
            "in_use": round(tenant.gpu_units_in_use / UNITS_PER_GPU, 3),
            "gpu_hours": round(usage[tenant.slug]["gpu_hours"], 2),
            "cost": round(usage[tenant.slug]["cost"], 2),
            "apps": apps.get(tenant.slug, (0, 0)),
        }
        for tenant in tenants
    ]


def _chart() -> dict[str, Any]:
    """Cost per tenant per day over the last DAYS days, for the usage chart."""

    today = timezone.now().date()
    days = [today - timedelta(days=offset) for offset in range(DAYS - 1, -1, -1)]
    cost: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in usage_by_tenant(since=days[0], by_day=True):
        cost[row["tenant"]][row["day"]] += float(row["cost_usd"])
    return {
        "labels": [day.isoformat() for day in days],
        "series": [
            {"tenant": slug, "cost": [round(cost[slug][day.isoformat()], 4) for day in days]}
            for slug in sorted(cost)
        ],
    }


@provider_admin
def center(request: HttpRequest) -> HttpResponse:
    context = {
        "tenants": _tenants(),
        "chart": _chart(),
        "page": "pmc",
        "base_domain": settings.KLIQUE_BASE_DOMAIN,
    }
    return render(request, "portal/pmc.html", context)


@provider_admin
def tenants_table(request: HttpRequest) -> HttpResponse:
    """The tenants table alone: the page reloads it in place every 30 seconds."""
    return render(request, "portal/_tenants.html", {"tenants": _tenants()})


@provider_admin
@require_POST
def tenant_create(request: HttpRequest) -> HttpResponse:
    """Create a tenant (HTMX): its address and its first admin's token, shown once."""

    context: dict[str, Any] = {}
    try:
        share = request.POST.get("gpu_share") or None
        created = tenancy.tenant_create(
            slug=request.POST.get("slug", "").strip(),
            name=request.POST.get("name", "").strip(),
            admin_username=request.POST.get("admin_username", "").strip(),
            gpu_share=int(share) if share is not None else None,
        )
        context["created"] = created
    except ValueError:
        context["error"] = "The GPU share is a whole number of GPUs."
    except KliqueError as error:
        context["error"] = error.message
    context["tenants"] = _tenants()
    return render(request, "portal/_tenant_created.html", context)


@provider_admin
@require_POST
def tenant_suspend(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = get_object_or_404(Tenant, slug=slug)
    context: dict[str, Any] = {}
    try:
        if tenant.is_suspended:
            tenancy.tenant_resume(tenant=tenant)
        else:
            tenancy.tenant_suspend(tenant=tenant, reason=request.POST.get("reason", ""))
    except KliqueError as error:
        context["error"] = error.message
    context["tenants"] = _tenants()
    return render(request, "portal/_tenant_created.html", context)
