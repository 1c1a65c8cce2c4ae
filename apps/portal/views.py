"""The tenant portal: server-rendered pages (templates in frontend/templates/portal/) that HTMX and the
tenant's websockets keep current without reloading. Pages sign people in with a session; everything they
show or change goes through the same services, selectors and role rules as the REST API."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any

from django.contrib import auth
from django.db import connection
from django.db.models import Sum
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from apps.accounts.models import Role, User
from apps.accounts.services import SignInLimited
from apps.core.errors import KliqueError
from apps.fleet.selectors import NONE_REPORTED, agents_by_pool, task_outputs
from apps.metering.ledger import gpu_hours, usd
from apps.metering.models import Rollup
from apps.metering.selectors import task_gpu_usage
from apps.resources.models import Pool
from apps.scheduling import services as scheduling
from apps.scheduling.engine import UNITS_PER_GPU
from apps.scheduling.models import ACTIVE_STATES, ENDED_STATES, Task, TaskEvent, TaskState
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
        target = context["next"] if str(context["next"]).startswith("/portal/") else "/portal/"
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


IDLE_BELOW = 80.0  # percent: a running task's GPUs averaging less than this over the last hour are idle


# The utilization chart's ranges: how many buckets of the ledger's rollups, of which grain.
RANGES = {"24h": (24, "hour"), "7d": (7, "day"), "30d": (30, "day")}


def _utilization_chart(pools: list[dict[str, Any]], now: Any, span: str) -> dict[str, Any]:
    """GPU utilization per hour (last 24 hours) or per day (last 7 or 30 days): metered GPU time over
    the pools' capacity. The ledger's rollups count an event in the hour (and day) it ended."""

    count, grain = RANGES.get(span, RANGES["24h"])
    hourly = grain == "hour"
    step = timedelta(hours=1) if hourly else timedelta(days=1)
    last = now.replace(minute=0, second=0, microsecond=0)
    if not hourly:
        last = last.replace(hour=0)
    buckets = [last - step * (count - 1 - offset) for offset in range(count)]
    used: dict[Any, float] = dict.fromkeys(buckets, 0.0)
    rows = Rollup.objects.filter(grain=grain, kind="gpu", bucket__gte=buckets[0]).values_list(
        "bucket", "gpu_unit_ms"
    )
    for bucket, unit_ms in rows:
        if bucket in used:
            used[bucket] += float(gpu_hours(unit_ms))
    capacity_hours = (sum(pool["capacity"] for pool in pools) or 1) * (1 if hourly else 24)
    return {
        "span": span if span in RANGES else "24h",
        "labels": [f"{bucket:%H:00}" if hourly else f"{bucket:%b %d}" for bucket in buckets],
        "percent": [round(100 * used[bucket] / capacity_hours, 1) for bucket in buckets],
    }


# Each running task's GPU samples of the last hour, averaged from the counts and sums each metric report
# got when it was kept (TaskReport.gpu_samples): a busy tenant keeps hundreds of thousands of metric
# reports an hour, and the dashboard reloads every 15 seconds.
_IDLE_SQL = """
SELECT report.task_id, sum(report.gpu_percent_sum) / sum(report.gpu_samples)
FROM fleet_taskreport report
JOIN scheduling_task task ON task.id = report.task_id AND task.state = 'running'
WHERE report.gpu_samples > 0 AND report.at >= %s
GROUP BY report.task_id
HAVING sum(report.gpu_percent_sum) / sum(report.gpu_samples) < %s
"""


def _idle(now: Any) -> list[dict[str, Any]]:
    """Running tasks whose GPUs averaged under IDLE_BELOW percent over the last hour (from the GPU samples
    their nodes report)."""

    with connection.cursor() as cursor:
        cursor.execute(_IDLE_SQL, [now - timedelta(hours=1), IDLE_BELOW])
        averages = dict(cursor.fetchall())
    tasks = Task.objects.filter(pk__in=list(averages)).select_related("pool", "submitter")
    idle = [
        {
            "task": task,
            "pool": task.pool.name if task.pool else "-",
            "user": task.submitter.username,
            "average": round(averages[task.pk], 1),
        }
        for task in tasks
    ]
    return sorted(idle, key=lambda row: row["average"])


def _dashboard(now: Any, span: str = "24h") -> dict[str, Any]:
    """What the dashboard shows, as of now: GPUs in use and free per pool, environment and GPU class;
    CPUs, workers and nodes per environment, as its agents last said; GPUs in use per group;
    utilization over the span asked for; idle GPUs."""

    agents = agents_by_pool()
    held = dict(
        Task.objects.filter(state__in=ACTIVE_STATES, pool__isnull=False)
        .values("pool_id")
        .annotate(units=Sum("size_units"))
        .values_list("pool_id", "units")
    )
    pools: list[dict[str, Any]] = []
    for pool in Pool.objects.order_by("environment", "name"):
        reported = agents.get(pool.pk, NONE_REPORTED)
        pools.append(
            {
                "name": pool.name,
                "environment": pool.environment,
                "gpu_class": pool.gpu_class or "-",
                "capacity": pool.capacity_gpus,
                "used": round((held.get(pool.pk) or 0) / UNITS_PER_GPU, 3),
                "workers": reported.workers,
                "online": pool.is_online(now),
                "cpus": reported.cpus,
                "cpus_in_use": reported.cpus_in_use,
                "nodes": reported.nodes,
            }
        )
    chart = {
        "labels": [pool["name"] for pool in pools],
        "used": [pool["used"] for pool in pools],
        "free": [max(pool["capacity"] - pool["used"], 0) for pool in pools],
    }
    by_group = dict(
        Task.objects.filter(state__in=ACTIVE_STATES, compute_resource__isnull=False)
        .values("compute_resource__policy__group__name")
        .annotate(units=Sum("size_units"))
        .values_list("compute_resource__policy__group__name", "units")
    )
    return {
        "pools": pools,
        "environments": _totals(pools, "environment"),
        "classes": _totals(pools, "gpu_class"),
        "chart": chart,
        "utilization": _utilization_chart(pools, now, span),
        "idle": _idle(now),
        "idle_below": IDLE_BELOW,
        "groups": sorted((group, round(units / UNITS_PER_GPU, 3)) for group, units in by_group.items()),
    }


def _known_sum(values: Any) -> int | None:
    """The sum of what is known; None when nothing is (no agent said)."""
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def _totals(pools: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The pools' GPUs, CPUs, workers and nodes summed by environment or GPU class."""
    totals: dict[str, dict[str, Any]] = {}
    for pool in pools:
        row = totals.setdefault(
            pool[key],
            {key: pool[key], "pools": 0, "capacity": 0, "used": 0.0, "workers": 0},
        )
        row["pools"] += 1
        row["capacity"] += pool["capacity"]
        row["used"] = round(row["used"] + pool["used"], 3)
        row["workers"] += pool["workers"]
        for count in ("cpus", "cpus_in_use", "nodes"):
            row[count] = _known_sum([row.get(count), pool[count]])
    for row in totals.values():
        row["free"] = round(max(row["capacity"] - row["used"], 0), 3)
    return list(totals.values())


@signed_in
def dashboard(request: HttpRequest) -> HttpResponse:
    """The dashboard; its figures reload in place (dashboard_live) on the tenant's task events and every
    15 seconds, and its charts redraw from them."""

    context = _dashboard(timezone.now(), request.GET.get("range", "24h"))
    context["events"] = TaskEvent.objects.select_related("task").order_by("-at")[:20]
    context["page"] = "dashboard"
    return render(request, "portal/dashboard.html", context)


@signed_in
def dashboard_live(request: HttpRequest) -> HttpResponse:
    return render(
        request, "portal/_dashboard_live.html", _dashboard(timezone.now(), request.GET.get("range", "24h"))
    )


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
