"""What people do with the catalogue: add entries, launch apps from them, stop and start them again; and
what the route and the agents' tunnels record of an app.

An app instance runs as a task on a compute resource like any other (the same policies, reservations,
preemption, metering and audit): launching submits it, stopping cancels it, starting again submits a new
one. The task runs once (`max_attempts` 1): an app that exits, or never answers its health check, is
stopped with the reason, and its owner starts it again.

A model endpoint (a template that `serves` a model) is registered in the tenant's gateway from its launch:
the gateway reaches it through its tunnel while it is ready; a stop takes it out, unless the stop was for
idleness and the template scales to zero, when the model stays listed and the next call starts it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.db.models import Sum
from django.utils import timezone

from apps.accounts.models import ApiToken, Group, Role, User
from apps.catalogue import shipped, slurm
from apps.catalogue.admissions import ADMISSIONS
from apps.catalogue.models import AppInstance, CatalogueEntry
from apps.core.errors import Conflict, Forbidden, InvalidInput, NotFound
from apps.core.events import publish_event
from apps.core.ids import as_uuid
from apps.fleet.models import TaskReport
from apps.resources.models import ComputeResource, Environment, TaskSharing
from apps.scheduling.engine.units import to_gpus_text
from apps.scheduling.models import ENDED_STATES, Task, TaskState
from apps.scheduling.services import (
    TaskRequest,
    compute_resource_open_to,
    task_cancel,
    task_size,
    tasks_submit,
)
from gateway import services as gateway
from protocol import clusters
from protocol.apps import Template, TemplateInvalid, secret_names

if TYPE_CHECKING:
    from tenants.models import Tenant

TOUCH_EVERY = timedelta(seconds=30)  # how stale an app's last request may be before the route writes it
IDLE_GPU_PERCENT = 5.0  # an app's GPUs averaging this or more over its idle timeout are working: not idle


def _invalid(error: TemplateInvalid, prefix: str = "") -> InvalidInput:
    lines = [f"{prefix}{problem}" for problem in error.problems]
    return InvalidInput(
        f"The template has {len(lines)} problem(s): " + "; ".join(lines), errors={"problems": lines}
    )


def entry_add(*, user: User, document: Any, allowed_for_projects: bool = True) -> CatalogueEntry:
    """Add an entry (one version of an app) from a template document, every problem listed by path."""
    if not user.has_role(Role.ADMIN):
        raise Forbidden("Only tenant admins add catalogue entries; project admins launch the allowed ones.")
    try:
        template = Template.parse(document)
    except TemplateInvalid as error:
        raise _invalid(error) from None
    if template.name in shipped.TEMPLATES:
        raise Conflict(f"{template.name} is an entry shipped with Klique; give yours another name.")
    try:
        with transaction.atomic():
            return CatalogueEntry.objects.create(
                name=template.name,
                version=template.version,
                template=template.as_json(),
                allowed_for_projects=allowed_for_projects,
                created_by=user.username,
            )
    except IntegrityError:
        raise Conflict(
            f"{template.name} {template.version} is in the catalogue already; a version is never changed, "
            "so add the template as a new version."
        ) from None


def entry_find(name: str, version: str | None = None) -> tuple[Template, bool]:
    """The template of an entry (its newest version unless one is named) and whether project admins may
    launch it; NotFound naming the catalogue's entries."""
    if name in shipped.TEMPLATES and version in (None, shipped.TEMPLATES[name].version):
        return shipped.TEMPLATES[name], True
    rows = CatalogueEntry.objects.filter(name=name)
    row = rows.filter(version=version).first() if version else rows.order_by("-created_at").first()
    if row is None:
        known = sorted({*shipped.TEMPLATES, *CatalogueEntry.objects.values_list("name", flat=True)})
        what = f"{name} {version}" if version else name
        raise NotFound(f"No catalogue entry {what}; the catalogue has {', '.join(known)}.")
    return Template.parse(row.template), row.allowed_for_projects


@transaction.atomic
def app_launch(
    *,
    tenant: Tenant,
    user: User,
    entry: str,
    version: str | None = None,
    variables: Mapping[str, Any] | None = None,
    compute_resource: str | None = None,
    gpus: str | None = None,
    project: str | None = None,
    name: str = "",
    share_with_project: bool = False,
    groups: list[str] | None = None,
    secrets: list[str] | None = None,
    token: ApiToken | None = None,
    worker_compute_resource: str | None = None,
) -> AppInstance:
    template, allowed = entry_find(entry, version)
    template = _with_workers_on(template, worker_compute_resource)
    if not allowed and not user.has_role(Role.ADMIN):
        raise Forbidden(f"{entry} is not allowed for projects; a tenant admin may launch it, or allow it.")
    try:
        values = template.values(variables or {})
    except TemplateInvalid as error:
        raise _invalid(error) from None
    problems: list[str] = []
    names = secret_names(secrets or [], problems)
    if problems:
        raise InvalidInput("; ".join(problems), field="secrets")
    resource = compute_resource or template.compute_resource
    if not resource:
        raise InvalidInput(
            f"{entry} names no compute resource of its own: choose one (GET /api/v1/compute-resources/).",
            field="compute_resource",
        )
    if template.cluster is not None:
        _cluster_fits(tenant, user, template, resource, gpus or template.gpus)
    shared_groups = _groups(user, groups or [])
    app = AppInstance(
        name=(name or template.title)[:100],
        entry_name=template.name,
        entry_version=template.version,
        template=template.as_json(),
        variables=values,
        secrets=list(names),
        compute_resource_name=resource,
        gpus=gpus or template.gpus,
        owner=user,
        shared_with_project=share_with_project,
    )
    task = _submit(tenant, user, app, template, project=project, token=token)
    app.task, app.project = task, task.project
    if share_with_project and task.project is None:
        raise InvalidInput("Sharing with the project needs a project: name one.", field="project")
    app.save()
    app.groups.set(shared_groups)
    _register_model(app, template)
    return app


def _with_workers_on(template: Template, resource: str | None) -> Template:
    """The template as launched, its Slurm cluster's workers on the compute resource the launch chose."""
    if not resource:
        return template
    if template.cluster is None or template.cluster.service != "slurm":
        raise InvalidInput(
            f"{template.name} makes no Slurm cluster: only a Slurm cluster's workers run on a compute "
            "resource of their own. Leave worker_compute_resource out.",
            field="worker_compute_resource",
        )
    return dataclasses.replace(
        template, cluster=dataclasses.replace(template.cluster, worker_compute_resource=resource)
    )


def _cluster_fits(tenant: Tenant, user: User, template: Template, resource: str, gpus: str) -> None:
    """A clustering service's cluster is made on Kubernetes pools only, its GPUs split evenly over its
    workers: said at launch, not by a task that fails on its agent."""
    assert template.cluster is not None
    if template.cluster.service == "slurm":
        _slurm_fits(tenant, user, template.cluster, resource)
        return
    found = compute_resource_open_to(user, resource)
    profile = found.profile
    if profile.nodes > 1 or profile.sharing != TaskSharing.WHOLE:
        raise InvalidInput(
            f"A {template.cluster.service} cluster is one app of whole GPUs on one compute resource; "
            f"{found.name} gives {profile.size_text()}. Choose one of whole GPUs on one node.",
            field="compute_resource",
        )
    size = gpus if profile.size_from_task else to_gpus_text(profile.size_units)  # a fixed size is the task's
    try:
        clusters.ClusterService.parse(template.cluster.as_json(), gpus=size)
    except clusters.ServiceInvalid as error:
        raise InvalidInput("; ".join(error.problems), field="gpus") from None
    _on_kubernetes(template.cluster.service, found)


def _on_kubernetes(service: str, found: ComputeResource, what: str = "compute_resource") -> None:
    others = sorted(
        f"{pool.name} ({pool.environment})"
        for pool in found.profile.pools.all()
        if pool.environment != Environment.KUBERNETES
    )
    if others:
        raise InvalidInput(
            f"A {service} cluster is made on Kubernetes pools; {found.name} also places work on "
            f"{', '.join(others)}. Choose a compute resource whose pools are all Kubernetes pools.",
            field=what,
        )


def _slurm_fits(tenant: Tenant, user: User, service: clusters.ClusterService, resource: str) -> None:
    """A Slurm cluster's controller and its workers run on Kubernetes pools; each worker is a task of
    `worker_gpus` whole GPUs on one node of the worker compute resource, which its launcher may use and
    where such a task could ever run (its policy's limit, the tenant's share): a worker refused when Slurm
    wakes its node would leave the node down."""
    _on_kubernetes("slurm", compute_resource_open_to(user, resource))
    name = service.worker_compute_resource or resource
    try:
        workers = compute_resource_open_to(user, name)
    except InvalidInput as error:
        raise InvalidInput(
            f"The cluster's workers run on {name}: {error.message}", field="compute_resource"
        ) from None
    _on_kubernetes("slurm", workers)
    profile = workers.profile
    what = f"Each worker of this Slurm cluster is a task of {service.worker_gpus} whole GPUs on one node"
    if profile.nodes > 1 or profile.sharing != TaskSharing.WHOLE:
        raise InvalidInput(
            f"{what}; {workers.name} gives {profile.size_text()}. Choose a worker compute resource that runs "
            "such tasks, or an entry whose worker_gpus it runs.",
            field="compute_resource",
        )
    try:
        task_size(tenant=tenant, resource=workers, gpus=str(service.worker_gpus))
    except InvalidInput as error:
        raise InvalidInput(
            f"{what} of {workers.name}: {error.message} Choose a worker compute resource that runs such "
            "tasks, or an entry whose worker_gpus it runs.",
            field="compute_resource",
        ) from None


def _register_model(app: AppInstance, template: Template) -> None:
    """Register the model the app serves in the tenant's gateway (InvalidInput where it may not)."""
    if template.serves is None:
        return
    model = template.serves.model_name(app.variables)
    gateway.selfhosted_register(
        app_id=app.pk,
        task_id=app.task_id,
        label=app.name,
        owner=app.owner,
        model_name=model,
        served_model=model,
        mode=template.serves.mode,
        input_cost_per_million=template.serves.input_cost_per_million,
        output_cost_per_million=template.serves.output_cost_per_million,
        project=app.project if app.shared_with_project else None,
        group_ids=[str(group) for group in app.groups.values_list("pk", flat=True)],
        startup_seconds=template.startup_seconds,
    )


def _groups(user: User, names: list[str]) -> list[Group]:
    found = list(Group.objects.filter(name__in=names))
    missing = sorted(set(names) - {group.name for group in found})
    if missing:
        raise InvalidInput(f"No group {', '.join(missing)}.", field="groups")
    if not user.has_role(Role.ADMIN) and any(
        not group.members.filter(pk=user.pk).exists() for group in found
    ):
        raise Forbidden("Share an app only with groups you are in; a tenant admin may share it with any.")
    return found


def _submit(
    tenant: Tenant,
    user: User,
    app: AppInstance,
    template: Template,
    *,
    project: str | None,
    token: ApiToken | None,
) -> Task:
    request = TaskRequest(
        compute_resource=app.compute_resource_name,
        gpus=app.gpus,
        name=f"app {app.name}",
        project=project if project is not None else (str(app.project_id) if app.project_id else None),
        max_attempts=1,
        spec=template.spec(app.variables, instance=str(app.pk), secrets=tuple(app.secrets)),
    )
    (task,) = tasks_submit(tenant=tenant, user=user, requests=[request], token=token)
    return task


def _may_manage(user: User, app: AppInstance) -> None:
    if app.owner_id != user.pk and not user.has_role(Role.ADMIN):
        raise Forbidden("Only the app's owner or a tenant admin may stop or start it.")


@transaction.atomic
def app_stop(
    *,
    tenant: Tenant,
    user: User,
    app: AppInstance,
    reason: str = "",
    actor: str = "",
    asleep: bool = False,
) -> AppInstance:
    """Stop the app: its task is cancelled (the agent stops it with its grace period), its route answers
    that it is stopped. Its files on the shared file system stay. The model it serves leaves the gateway,
    unless it is stopped `asleep` (for idleness, scaling to zero): then the next call starts it again.
    Stopping a sleeping model's app takes its model out of the gateway."""
    _may_manage(user, app)
    app = AppInstance.objects.select_for_update(of=("self",)).select_related("task").get(pk=app.pk)
    if app.task is None or app.task.state in ENDED_STATES:
        if gateway.selfhosted_asleep(app.pk):
            gateway.selfhosted_remove(app.pk)
            app.stop_reason = reason or f"Stopped by {user.username}; its model left the gateway."
            app.save(update_fields=["stop_reason"])
            return app
        raise InvalidInput(f"{app.name} is stopped already; start it again with POST .../start/.")
    app.stop_requested_at = timezone.now()
    app.stop_reason = reason or f"Stopped by {user.username}."
    app.save(update_fields=["stop_requested_at", "stop_reason"])
    ADMISSIONS.forget(app.tunnel_channel)  # this process's route asks the database again at once
    if asleep:
        gateway.selfhosted_set(app.pk, state="asleep", channel="")
    else:
        gateway.selfhosted_remove(app.pk)
    app.task = task_cancel(tenant=tenant, user=user, task=app.task, why=app.stop_reason, actor=actor)
    if ((app.template or {}).get("cluster") or {}).get("service") == "slurm":
        slurm.workers_end(
            tenant=tenant, app=app, why=f"Its Slurm cluster {app.name} stopped: {app.stop_reason}"
        )
    return app


def apps_reclaim_idle(*, tenant: Tenant, now: datetime | None = None) -> list[AppInstance]:
    """Stop each running app with an idle timeout that no request reached through its route for that long
    and, where it holds GPUs, whose GPUs averaged under IDLE_GPU_PERCENT over that time as its agent
    sampled them (a notebook training with no one watching is not idle; with no samples, nothing says it
    works). Its GPUs go back to the pool; its owner reads why on the app's page and in its task's reason,
    and an event says so. The apps stopped."""
    now = now or timezone.now()
    stopped = []
    running = AppInstance.objects.filter(task__state=TaskState.RUNNING, stop_requested_at=None)
    for app in running.select_related("task", "owner"):
        timeout = (app.template or {}).get("idle_timeout_seconds")
        calls = [at for at in (app.last_request_at, gateway.selfhosted_last_call(app.pk)) if at]
        last = max(calls) if calls else app.ready_at
        if not timeout or last is None or app.task is None or now - last < timedelta(seconds=timeout):
            continue
        gpus = ""
        if app.task.size_units:
            since = now - timedelta(seconds=timeout)
            samples = TaskReport.objects.filter(task=app.task, at__gte=since, gpu_samples__gt=0).aggregate(
                total=Sum("gpu_percent_sum"), count=Sum("gpu_samples")
            )
            if samples["count"]:
                average = samples["total"] / samples["count"]
                if average >= IDLE_GPU_PERCENT:
                    continue
                gpus = f" and its GPUs averaged {average:.0f}%"
        minutes = max(1, round(timeout / 60))
        serves = (app.template or {}).get("serves") or {}
        asleep = serves.get("when_idle") == "scale_to_zero"
        again = (
            "The next call to its model through the gateway starts it again."
            if asleep
            else "Start it again from its address."
        )
        reason = (
            f"Stopped after {minutes} minute(s) without a request{gpus} (its idle timeout); its files stay. "
            + again
        )
        stopped.append(
            app_stop(tenant=tenant, user=app.owner, app=app, reason=reason, actor="klique", asleep=asleep)
        )
        publish_event(
            tenant=tenant, kind="app.idle_stopped", data={"id": str(app.pk), "owner": app.owner.username}
        )
    return stopped


@transaction.atomic
def app_start(*, tenant: Tenant, user: User, app: AppInstance, token: ApiToken | None = None) -> AppInstance:
    """Start a stopped app again, as a new task with the same template and variables."""
    _may_manage(user, app)
    app = AppInstance.objects.select_for_update(of=("self",)).select_related("task").get(pk=app.pk)
    if app.task is not None and app.task.state not in ENDED_STATES:
        raise Conflict(f"{app.name} is running already ({app.task.state}).")
    template = Template.parse(app.template)
    owner = app.owner
    app.task = _submit(
        tenant, owner, app, template, project=None, token=token if user.pk == owner.pk else None
    )
    app.tunnel_channel, app.tunnel_lease, app.ready_at = "", None, None
    app.stop_requested_at, app.stop_reason = None, ""
    app.save()
    _register_model(app, template)
    return app


def app_wake(*, tenant: Tenant, app_id: Any) -> AppInstance | None:
    """A gateway call wants the model of a sleeping app: start the app again as its owner's. An app that
    is running already is left as it is; one stopped for good takes its model out of the gateway."""
    app = AppInstance.objects.select_related("task", "owner").filter(pk=app_id).first()
    if app is None:
        gateway.selfhosted_remove(app_id)
        return None
    if app.task is not None and app.task.state not in ENDED_STATES:
        return app
    if not gateway.selfhosted_asleep(app.pk):
        gateway.selfhosted_remove(app.pk)
        return None
    app = app_start(tenant=tenant, user=app.owner, app=app)
    publish_event(tenant=tenant, kind="app.woken", data={"id": str(app.pk), "owner": app.owner.username})
    return app


# The route and the tunnels ------------------------------------------------------------------------------


@transaction.atomic
def tunnel_open(*, pool_id: Any, agent_id: str, task_id: str, lease_id: str, channel: str) -> AppInstance:
    """Record the tunnel an agent opened for an app it runs, under the run's lease: the app is ready.
    NotFound unless the lease is the live, running run of an app task of the agent's pool, by that agent."""
    if as_uuid(task_id) is None or as_uuid(lease_id) is None:
        raise NotFound("Name the app's task and the lease of its run (X-Klique-Task, X-Klique-Lease).")
    task = (
        Task.objects.filter(pk=task_id, pool_id=pool_id, state=TaskState.RUNNING, lease_id=lease_id)
        .filter(runs__lease_id=lease_id, runs__agent_id=agent_id)
        .first()
    )
    app_id = ((task.spec or {}).get("app") or {}).get("instance") if task is not None else None
    app = AppInstance.objects.select_for_update().filter(pk=app_id, task=task).first() if app_id else None
    if task is None or app is None:
        raise NotFound(f"Task {task_id} is not a running app of this agent under lease {lease_id}.")
    now = timezone.now()
    app.tunnel_channel, app.tunnel_lease = channel, lease_id
    app.ready_at = app.ready_at or now
    app.last_request_at = app.last_request_at or now
    app.save(update_fields=["tunnel_channel", "tunnel_lease", "ready_at", "last_request_at"])
    gateway.selfhosted_set(app.pk, state="ready", channel=channel)
    return app


def tunnel_closed(*, app_id: Any, channel: str) -> None:
    """The tunnel on `channel` is gone; a newer one of the app stays."""
    AppInstance.objects.filter(pk=app_id, tunnel_channel=channel).update(tunnel_channel="")
    gateway.selfhosted_tunnel_gone(app_id, channel)


def app_touch(app: AppInstance) -> None:
    """A request went through the app's route: it is not idle (written at most every TOUCH_EVERY)."""
    now = timezone.now()
    if app.last_request_at is None or now - app.last_request_at > TOUCH_EVERY:
        AppInstance.objects.filter(pk=app.pk).update(last_request_at=now)
