"""The tenant portal: server-rendered pages (templates in frontend/templates/portal/) that HTMX and the
tenant's websockets keep current without reloading. Pages sign people in with a session; everything they
show or change goes through the same services, selectors and role rules as the REST API."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib import auth
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from apps.accounts.models import Role, User
from apps.accounts.services import SignInLimited
from apps.core.errors import KliqueError
from apps.fleet.selectors import task_outputs
from apps.metering.ledger import gpu_hours, usd
from apps.metering.selectors import task_gpu_usage
from apps.portal.dashboard import dashboard_figures, objective_figures
from apps.scheduling import services as scheduling
from apps.scheduling.models import ENDED_STATES, TaskEvent, TaskState
from apps.scheduling.selectors import (
    compute_resources_for,
    may_read_output,
    output_readers,
    tasks_visible_to,
    why,
)
from apps.scheduling.services import TaskRequest, tasks_submit
from apps.sso.models import Provider
from apps.sso.services import SignInRefused, password_sign_in

View = Callable[..., HttpResponse]


def signed_in(view: View) -> View:
    """A page for a signed-in person of this tenant; anyone else goes to the sign-in page."""

    @wraps(view)
    def check(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        user = request.user
        if not isinstance(user, User) or not user.is_active:
            return HttpResponseRedirect(f"/portal/sign-in/?next={request.path}")
        return view(request, *args, **kwargs)

    return check


@require_http_methods(["GET", "POST"])
def sign_in(request: HttpRequest) -> HttpResponse:
    provider = Provider.objects.filter(pk=1).first()
    context: dict[str, Any] = {
        "sso": provider is not None,
        "passwords": provider is None or provider.break_glass_passwords,
        "next": request.GET.get("next") or request.POST.get("next") or "/portal/",
        "tenant": getattr(request, "tenant", None),
    }
    if request.method == "POST":
        try:
            password_sign_in(request, request.POST.get("username", ""), request.POST.get("password", ""))
        except SignInRefused as refused:
            context["error"] = str(refused)
            return render(request, "portal/sign_in.html", context, status=401)
        except SignInLimited as limited:
            context["error"] = str(limited)
            return render(request, "portal/sign_in.html", context, status=429)
        target = context["next"] if str(context["next"]).startswith(("/portal/", "/apps/")) else "/portal/"
        return HttpResponseRedirect(target)
    return render(request, "portal/sign_in.html", context)


@require_POST
def sign_out(request: HttpRequest) -> HttpResponse:
    auth.logout(request)
    return HttpResponseRedirect("/portal/sign-in/")


def _tasks(user: User) -> list[dict[str, Any]]:
    """The person's latest tasks, each queued one with its place in its queue (as `klique why` says)."""

    rows = []
    for task in tasks_visible_to(user).filter(submitter=user).order_by("-submitted_at")[:50]:
        position = why(task).position if task.state == TaskState.QUEUED else None
        rows.append({"task": task, "position": position})
    return rows


@signed_in
def tasks(request: HttpRequest) -> HttpResponse:
    user = request.user
    assert isinstance(user, User)
    resources = [resource for resource in compute_resources_for(user) if user.has_role(Role.MEMBER)]
    return render(
        request, "portal/tasks.html", {"tasks": _tasks(user), "resources": resources, "page": "tasks"}
    )


@signed_in
def tasks_table(request: HttpRequest) -> HttpResponse:
    user = request.user
    assert isinstance(user, User)
    return render(request, "portal/_tasks_table.html", {"tasks": _tasks(user)})


def _request(request: HttpRequest, user: User) -> Any:
    """The task the submit form asks for, or KliqueError saying what is wrong with the form."""

    if not user.has_role(Role.MEMBER):
        raise KliqueError(f"Submitting needs the member role and {user.username} is a {user.role}.")
    command = request.POST.get("command", "").split()
    if not command:
        raise KliqueError("Say what to run: a command, as python train.py --epochs 3.")
    return TaskRequest(
        compute_resource=request.POST.get("compute_resource", ""),
        gpus=request.POST.get("gpus") or None,
        name=request.POST.get("name", ""),
        spec={"command": command},
    )


@signed_in
@require_POST
def task_submit(request: HttpRequest) -> HttpResponse:
    """The submit form (HTMX): says the task is queued, or what was wrong, and refreshes the table."""

    user = request.user
    assert isinstance(user, User)
    context: dict[str, Any] = {}
    try:
        tenant = request.tenant  # type: ignore[attr-defined]
        (task,) = tasks_submit(tenant=tenant, user=user, requests=[_request(request, user)])
        context["message"] = f"Task {task.name or str(task.pk)[:8]} is {task.state}."
    except KliqueError as error:
        context["error"] = error.message
    context["tasks"] = _tasks(user)
    return render(request, "portal/_submitted.html", context)


def _may_cancel(user: User, task: Any) -> bool:
    """As the API has it: a member may cancel their own task that has not ended; an admin anyone's."""

    mine = task.submitter_id == user.pk and user.has_role(Role.MEMBER)
    return task.state not in ENDED_STATES and (mine or user.has_role(Role.ADMIN))


def _facts(request: HttpRequest, task_id: str) -> tuple[User, Any]:
    user = request.user
    assert isinstance(user, User)
    return user, get_object_or_404(tasks_visible_to(user).select_related("pool", "submitter"), pk=task_id)


def _metered(task: Any) -> dict[str, Any] | None:
    """The GPU time and cost the ledger holds for the task's runs (a running run's is metered hour by
    hour), or None before any."""

    sums = task_gpu_usage(task_id=task.pk, user_id=task.submitter_id, since=task.submitted_at)
    return (
        None if sums is None else {"gpu_hours": gpu_hours(sums["gpu_unit_ms"]), "usd": usd(sums["cost"] or 0)}
    )


@signed_in
def task(request: HttpRequest, task_id: str) -> HttpResponse:
    user, found = _facts(request, task_id)
    readable = may_read_output(user, found)
    context = {
        "task": found,
        "metered": _metered(found),
        "may_read_output": readable,
        "output_readers": output_readers(found),
        "outputs": task_outputs(found).order_by("name") if readable else [],
        "may_cancel": _may_cancel(user, found),
        "page": "tasks",
    }
    return render(request, "portal/task.html", context)


@signed_in
def task_facts(request: HttpRequest, task_id: str) -> HttpResponse:
    """A task's state, pool, reason and metered GPU time (HTMX): its page reloads them on the tenant's task
    events."""
    user, found = _facts(request, task_id)
    context = {"task": found, "metered": _metered(found), "may_cancel": _may_cancel(user, found)}
    return render(request, "portal/_task_facts.html", context)


@signed_in
@require_POST
def task_cancel(request: HttpRequest, task_id: str) -> HttpResponse:
    """Cancel the task (HTMX): its facts again, saying so, or why not."""

    user, found = _facts(request, task_id)
    context: dict[str, Any] = {}
    status = 200
    if not _may_cancel(user, found):
        context["error"] = (
            "Only the task's submitter (a member) or a tenant admin may cancel it, before it ends."
        )
        status = 403
    else:
        try:
            found = scheduling.task_cancel(tenant=request.tenant, user=user, task=found)  # type: ignore[attr-defined]
            context["message"] = "Cancelled."
        except KliqueError as error:
            context["error"] = error.message
    context.update(task=found, metered=_metered(found), may_cancel=_may_cancel(user, found))
    return render(request, "portal/_task_facts.html", context, status=status)


@signed_in
def dashboard(request: HttpRequest) -> HttpResponse:
    """The dashboard; its figures reload in place (dashboard_live) on the tenant's task events and every
    15 seconds, and its charts redraw from them."""

    context = dashboard_figures(timezone.now(), request.GET.get("range", "24h"))
    context["objectives"] = objective_figures()
    context["events"] = TaskEvent.objects.select_related("task").order_by("-at")[:20]
    context["page"] = "dashboard"
    return render(request, "portal/dashboard.html", context)


@signed_in
def dashboard_live(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "portal/_dashboard_live.html",
        dashboard_figures(timezone.now(), request.GET.get("range", "24h")),
    )


@signed_in
def dashboard_objectives(request: HttpRequest) -> HttpResponse:
    """The queue-wait objectives' part of the dashboard, reloaded every minute (they are measured so)."""
    return render(request, "portal/_objectives.html", {"objectives": objective_figures()})


def admin_only(view: View) -> View:
    """A page for the tenant's admins; others are told so, in a sentence."""

    @wraps(view)
    def check(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        user = request.user
        if isinstance(user, User) and not user.has_role(Role.ADMIN):
            return render(
                request,
                "portal/refused.html",
                {"message": f"This page needs the admin role and {user.username} is a {user.role}."},
                status=403,
            )
        return view(request, *args, **kwargs)

    return signed_in(check)
