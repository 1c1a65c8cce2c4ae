"""Who may see and reach which apps, and what state each is in, in words a user understands."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from apps.accounts.models import Role, User
from apps.catalogue import shipped
from apps.catalogue.models import AppInstance, CatalogueEntry
from apps.metering.ledger import gpu_hours, usd
from apps.metering.selectors import tasks_gpu_usage
from apps.scheduling.models import ENDED_STATES, Task, TaskState
from protocol.apps import Template
from tenants.models import Tenant

STARTING, READY, IDLE, STOPPING, STOPPED = "starting", "ready", "idle", "stopping", "stopped"
IDLE_AFTER = timedelta(minutes=5)  # no request through the route for this long: the app is idle


def apps_visible_to(user: User) -> QuerySet[AppInstance]:
    """The apps `user` may see and reach: their own, those shared with a project they are in or with one
    of their groups; a tenant admin sees every app."""
    apps = AppInstance.objects.select_related("task", "owner", "project").prefetch_related("groups")
    if user.has_role(Role.ADMIN):
        return apps
    return apps.filter(
        Q(owner=user) | Q(shared_with_project=True, project__memberships__user=user) | Q(groups__members=user)
    ).distinct()


def can_reach(user: User, app: AppInstance) -> bool:
    """Whether the route serves `app` to `user`: its owner, the people it is shared with. Administrators
    see that an app exists, but reach its contents only where it is shared with them too."""
    if not user.is_active:
        return False
    if app.owner_id == user.pk:
        return True
    if (
        app.shared_with_project
        and app.project is not None
        and app.project.memberships.filter(user=user).exists()
    ):
        return True
    return app.groups.filter(members=user).exists()


@dataclass(frozen=True)
class AppState:
    state: str
    detail: str


def app_state(app: AppInstance, now: datetime | None = None) -> AppState:  # noqa: PLR0911 -- a state each
    now = now or timezone.now()
    task: Task | None = app.task
    if task is None or task.state in ENDED_STATES:
        if task is None:
            return AppState(STOPPED, "Not started.")
        if app.stop_reason:
            return AppState(STOPPED, app.stop_reason)
        return AppState(STOPPED, task.reason or f"Its task {task.state}.")
    if app.stop_requested_at is not None:
        return AppState(STOPPING, app.stop_reason or "Stopping.")
    if task.state != TaskState.RUNNING:
        return AppState(STARTING, task.reason or f"Its task is {task.state}.")
    if not app.tunnel_channel:
        if app.ready_at is None:
            return AppState(STARTING, "Running; waiting for the app to answer its health check.")
        return AppState(STARTING, "Running; its agent is reconnecting the app's route.")
    last = app.last_request_at or app.ready_at or now
    if now - last > IDLE_AFTER:
        return AppState(IDLE, f"No requests since {last:%Y-%m-%d %H:%M} UTC.")
    return AppState(READY, "Serving.")


def app_tasks(app: AppInstance) -> QuerySet[Task]:
    """Every task that ran the app: one per launch or start."""
    return Task.objects.filter(spec__app__instance=str(app.pk))


def app_usage(app: AppInstance, now: datetime | None = None) -> dict[str, Decimal]:
    """The app's GPU time so far (its runs' metered hours, and the running run's time since; a Slurm
    cluster's, its worker nodes' too) and the cost the ledger holds for it (metered hour by hour while it
    runs)."""
    return apps_usage([app], now)[app.pk]


def apps_usage(apps: list[AppInstance], now: datetime | None = None) -> dict[Any, dict[str, Decimal]]:
    """app_usage of each app, by its id, in three queries whatever their number (the portal's list)."""
    now = now or timezone.now()
    fields = (
        "id",
        "submitter_id",
        "submitted_at",
        "state",
        "started_at",
        "metered_until",
        "size_units",
        "spec",
    )
    tasks = list(Task.objects.filter(spec__app__instance__in=[str(app.pk) for app in apps]).only(*fields))
    owner = {task.pk: str(task.spec["app"]["instance"]) for task in tasks}
    # A Slurm cluster's worker nodes are tasks of their own: the cluster's time and cost are theirs too.
    workers = Task.objects.filter(cluster_worker__app__in=apps).annotate(of_app=F("cluster_worker__app_id"))
    for worker in workers.only(*fields):
        tasks.append(worker)
        owner[worker.pk] = str(worker.of_app)
    metered = tasks_gpu_usage([(task.pk, task.submitter_id, task.submitted_at) for task in tasks])
    totals = {str(app.pk): [Decimal(0), Decimal(0)] for app in apps}
    for task in tasks:
        total = totals[owner[task.pk]]
        sums = metered.get(str(task.pk))
        if sums is not None:
            total[0] += Decimal(sums["gpu_unit_ms"] or 0)
            total[1] += Decimal(sums["cost"] or 0)
        since = task.metered_until or task.started_at
        if task.state == TaskState.RUNNING and since is not None:
            total[0] += Decimal(task.size_units) * Decimal(max(0.0, (now - since).total_seconds()) * 1000)
    return {
        app.pk: {"gpu_hours": gpu_hours(totals[str(app.pk)][0]), "usd": usd(totals[str(app.pk)][1])}
        for app in apps
    }


def entries_newest() -> list[Template]:
    """Each entry of the catalogue, shipped or the tenant's own, in its newest version; by title."""
    newest: dict[str, Template] = dict(shipped.TEMPLATES)
    for row in CatalogueEntry.objects.order_by("name", "created_at"):  # the newest version comes last
        newest[row.name] = Template.parse(row.template)
    return sorted(newest.values(), key=lambda template: template.title.lower())


def served_model(app: AppInstance) -> str | None:
    """The model an app serves through the tenant's gateway, by its name there; None for other apps."""
    serves = (app.template or {}).get("serves")
    if not isinstance(serves, dict):
        return None
    variable = serves.get("model_variable")
    name = (app.variables or {}).get(variable, "") if variable else serves.get("model", "")
    return str(name) or None


def apps_by_tenant(tenants: list[Tenant]) -> dict[str, tuple[int, int]]:
    """Each tenant's apps, for the provider's center: (running, all), by tenant slug. One query per 200
    tenants, across their schemas."""
    found: dict[str, tuple[int, int]] = {}
    apps, tasks = AppInstance._meta.db_table, Task._meta.db_table
    for start in range(0, len(tenants), 200):
        batch = [tenant for tenant in tenants[start : start + 200] if tenant.schema_name != "public"]
        if not batch:
            continue
        parts, values = [], []
        for tenant in batch:
            schema = connection.ops.quote_name(tenant.schema_name)
            parts.append(
                f"SELECT %s, count(*) FILTER (WHERE t.state = %s), count(*) FROM {schema}.{apps} a "  # noqa: S608 -- quoted names
                f"LEFT JOIN {schema}.{tasks} t ON t.id = a.task_id"
            )
            values += [tenant.slug, TaskState.RUNNING]
        with connection.cursor() as cursor:
            cursor.execute(" UNION ALL ".join(parts), values)
            for slug, running, total in cursor.fetchall():
                found[slug] = (int(running), int(total))
    return found
