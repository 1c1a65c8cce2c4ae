"""The portal's Apps page: the catalogue with a launch form per entry (its variables, a compute resource,
sharing), and the apps the signed-in person may see, with their state, address, GPU time and cost so
far, stop and start. The same services and selectors as the API (apps.catalogue)."""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_POST

from apps.accounts.models import Role, User
from apps.catalogue import selectors, services
from apps.core.errors import KliqueError
from apps.portal.views import signed_in
from apps.scheduling.selectors import compute_resources_for


def _user(request: HttpRequest) -> User:
    user = request.user
    assert isinstance(user, User)
    return user


def _apps(user: User) -> list[dict[str, Any]]:
    rows = []
    apps = list(selectors.apps_visible_to(user)[:200])
    usage = selectors.apps_usage(apps)  # three queries for the page, not three per app
    for app in apps:
        state = selectors.app_state(app)
        rows.append(
            {
                "app": app,
                "state": state,
                "usage": usage[app.pk],
                "manage": app.owner_id == user.pk or user.has_role(Role.ADMIN),
                "reach": selectors.can_reach(user, app),
                "model": selectors.served_model(app),
            }
        )
    return rows


@signed_in
def apps_page(request: HttpRequest) -> HttpResponse:
    user = _user(request)
    context = {
        "page": "apps",
        "entries": selectors.entries_newest(),
        "resources": compute_resources_for(user).order_by("name"),
        "projects": user.projects.order_by("name"),
        "apps": _apps(user),
        "may_launch": user.has_role(Role.MEMBER),
    }
    return render(request, "portal/apps.html", context)


@signed_in
def apps_table(request: HttpRequest) -> HttpResponse:
    return render(request, "portal/_apps.html", {"apps": _apps(_user(request))})


@signed_in
@require_POST
def app_launch(request: HttpRequest) -> HttpResponse:
    user = _user(request)
    form = request.POST
    context: dict[str, Any] = {}
    variables = {key.removeprefix("var-"): value for key, value in form.items() if key.startswith("var-")}
    if not user.has_role(Role.MEMBER):
        context = {"error": "Viewers do not launch apps; ask for the member role.", "apps": _apps(user)}
        return render(request, "portal/_apps.html", context, status=403)
    try:
        app = services.app_launch(
            tenant=request.tenant,  # type: ignore[attr-defined]
            user=user,
            entry=form.get("entry", ""),
            variables=variables,
            compute_resource=form.get("compute_resource") or None,
            gpus=form.get("gpus") or None,
            project=form.get("project") or None,
            share_with_project=form.get("share_with_project") == "on",
            name=form.get("name", "").strip(),
            secrets=[name.strip() for name in form.get("secrets", "").split(",") if name.strip()],
            worker_compute_resource=form.get("worker_compute_resource") or None,
        )
        context["message"] = f"{app.name} is starting; it opens from the list when it is ready."
    except KliqueError as error:
        context["error"] = error.message
    context["apps"] = _apps(user)
    return render(request, "portal/_apps.html", context)


@signed_in
@require_POST
def app_stop_or_start(request: HttpRequest, app_id: str, action: str) -> HttpResponse:
    if action not in ("stop", "start"):
        raise Http404("No such action.")
    user = _user(request)
    app = get_object_or_404(selectors.apps_visible_to(user), pk=app_id)
    context: dict[str, Any] = {}
    tenant = request.tenant  # type: ignore[attr-defined]
    try:
        if action == "stop":
            services.app_stop(tenant=tenant, user=user, app=app)
            context["message"] = f"{app.name} is stopping; its files stay."
        else:
            services.app_start(tenant=tenant, user=user, app=app)
            context["message"] = f"{app.name} is starting again."
    except KliqueError as error:
        context["error"] = error.message
    context["apps"] = _apps(user)
    return render(request, "portal/_apps.html", context)
