"""The workers of Slurm clusters (protocol.clusters): tasks made and ended as each cluster's controller asks.

A Slurm cluster's nodes are CLOUD nodes of Slurm's power saving. When jobs wait for nodes, slurmctld runs
its ResumeProgram, which asks the plane for those nodes with the controller run's task token; the plane
submits a worker task per node (the app owner's, on the cluster's worker compute resource, in the app's
project), so each worker is counted in policies, queued, preempted and metered like any task. When a node
has been idle its `idle_seconds`, the SuspendProgram gives it back and its task is cancelled. A worker
never outlives its controller's run: stopping the app ends them at once, and the catalogue's periodic pass
ends any whose controller run is over (failed, preempted, its lease expired). The other way round, a
worker task that ended while Slurm still counted on its node (preempted, failed) is seen by the
controller's reconciler, which reads the live nodes here and has Slurm power the node down: its jobs are
requeued and the node is woken again, as a new task, when jobs want it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import transaction

from apps.catalogue.models import AppInstance, ClusterWorker
from apps.core.errors import InvalidInput, KliqueError, NotFound
from apps.core.events import publish_event
from apps.scheduling.models import ENDED_STATES, Task, TaskState
from apps.scheduling.services import TaskRequest, task_cancel, tasks_submit
from protocol import clusters, pods
from protocol.apps import AppSpec, TemplateInvalid

if TYPE_CHECKING:
    from tenants.models import Tenant

IN_A_RUN = (TaskState.DISPATCHING, TaskState.RUNNING)
# A worker's task not ended yet. Asked for by name, not as "not ended": the tasks' (state, pool) index
# then finds the few live ones, where "not ended" would read every worker a cluster ever woke.
NOT_ENDED = tuple(state for state in TaskState if state not in ENDED_STATES)


@dataclass
class Changed:
    made: list[str] = field(default_factory=list)  # nodes given a worker task now
    kept: list[str] = field(default_factory=list)  # nodes whose worker task was there already
    ended: list[str] = field(default_factory=list)  # nodes whose worker task was cancelled
    refused: dict[str, str] = field(default_factory=dict)  # node: why its task could not be made

    def as_json(self) -> dict[str, Any]:
        return {"made": self.made, "kept": self.kept, "ended": self.ended, "refused": self.refused}


def _service(controller: Task) -> clusters.ClusterService:
    try:
        app = AppSpec.parse((controller.spec or {}).get("app"))
    except TemplateInvalid:
        app = None
    if app is None or app.cluster is None or app.cluster.service != "slurm":
        raise NotFound(f"Task {controller.pk} is not the controller of a Slurm cluster.")
    return app.cluster


def _nodes(controller: Task, service: clusters.ClusterService, hostlist: object) -> list[str]:
    """The cluster's nodes a host list names; InvalidInput for any other name."""
    if not isinstance(hostlist, str):
        raise InvalidInput('Send {"resume": "<host list>"} or {"suspend": "<host list>"}.')
    try:
        names = clusters.expand_hostlist(hostlist)
    except ValueError as error:
        raise InvalidInput(str(error)) from None
    job = pods.job_name(str(controller.pk), str(controller.lease_id))
    known = set(clusters.slurm_nodes(job, service))
    strangers = sorted(set(names) - known)
    if strangers:
        raise InvalidInput(f"{', '.join(strangers[:5])}: not a node of this cluster.")
    return list(dict.fromkeys(names))


def _live_workers(controller: Task) -> dict[str, ClusterWorker]:
    assert controller.lease_id is not None  # a task token is good only for a run
    workers = ClusterWorker.objects.select_related("task").filter(
        controller=controller, controller_lease=controller.lease_id
    )
    return {worker.node: worker for worker in workers.filter(task__state__in=NOT_ENDED)}


@transaction.atomic
def workers_change(
    *, tenant: Tenant, controller: Task, resume: object = None, suspend: object = None
) -> Changed:
    """What the cluster's controller asks, with its run's task token (the caller checked it and locked the
    controller's row): worker tasks for the nodes Slurm wakes, and the end of those it gives back.
    Asking twice for a node changes nothing."""
    service = _service(controller)
    app = AppInstance.objects.select_related("owner").filter(task=controller).first()
    if app is None:
        raise NotFound(f"Task {controller.pk} runs no app.")
    changed = Changed()
    live = _live_workers(controller)
    for node in _nodes(controller, service, suspend) if suspend is not None else []:
        worker = live.pop(node, None)
        if worker is not None:
            why = (
                f"Slurm gave {node} back: idle for {service.idle_seconds} s, or not up within "
                f"{clusters.RESUME_SECONDS // 60} minutes (its resume timeout)."
            )
            _end(tenant, app, worker.task, why)
            changed.ended.append(node)
    for node in _nodes(controller, service, resume) if resume is not None else []:
        if node in live:
            changed.kept.append(node)
            continue
        try:
            with transaction.atomic():
                task = _submit(tenant, app, controller, service, node)
        except KliqueError as error:
            changed.refused[node] = error.message
            continue
        ClusterWorker.objects.create(
            app=app, controller=controller, controller_lease=str(controller.lease_id), node=node, task=task
        )
        changed.made.append(node)
    if changed.made or changed.ended or changed.refused:
        publish_event(
            tenant=tenant,
            kind="app.cluster_workers",
            data={"id": str(app.pk), "owner": app.owner.username, **changed.as_json()},
        )
    return changed


def workers_live(*, controller: Task) -> list[str]:
    """The nodes of the controller's run that have a worker task not ended (queued or running), by name:
    what its reconciler compares with what Slurm believes."""
    _service(controller)
    return sorted(_live_workers(controller))


def _submit(
    tenant: Tenant, app: AppInstance, controller: Task, service: clusters.ClusterService, node: str
) -> Task:
    job = pods.job_name(str(controller.pk), str(controller.lease_id))
    spec: dict[str, Any] = {
        "command": clusters.worker_command(node, clusters.slurm_controller(job)),
        clusters.WORKER_SECTION: {
            "controller": str(controller.pk),
            "lease": str(controller.lease_id),
            "node": node,
            "secret": clusters.slurm_secret(job),
            "cpus": service.worker_cpus,
        },
    }
    image = (controller.spec or {}).get("image")
    if image:
        spec["image"] = image
    request = TaskRequest(
        compute_resource=service.worker_compute_resource or app.compute_resource_name,
        gpus=str(service.worker_gpus),
        name=f"{node} of {app.name}"[:200],
        project=str(controller.project_id) if controller.project_id else None,
        max_attempts=1,  # a worker that ends is woken again by Slurm, as a new task
        spec=spec,
    )
    (task,) = tasks_submit(tenant=tenant, user=app.owner, requests=[request])
    return task


def _end(tenant: Tenant, app: AppInstance, task: Task, why: str) -> None:
    if task.state not in ENDED_STATES:
        task_cancel(tenant=tenant, user=app.owner, task=task, why=why, actor="klique")


@transaction.atomic
def workers_end(*, tenant: Tenant, app: AppInstance, why: str) -> list[str]:
    """End every worker of the app's cluster (the app is stopping); the nodes whose task was ended."""
    ended = []
    workers = ClusterWorker.objects.select_related("task").filter(app=app, task__state__in=NOT_ENDED)
    for worker in workers:
        _end(tenant, app, worker.task, why)
        ended.append(worker.node)
    return ended


@transaction.atomic
def workers_sweep(*, tenant: Tenant) -> list[str]:
    """End the workers whose controller run is over: it failed, was preempted or lost its agent, or the
    app was started again since. The nodes whose task was ended."""
    ended = []
    live = ClusterWorker.objects.select_related("task", "controller", "app__owner").filter(
        task__state__in=NOT_ENDED
    )
    for worker in live:
        controller = worker.controller
        if controller.state in IN_A_RUN and controller.lease_id == worker.controller_lease:
            continue
        _end(tenant, worker.app, worker.task, f"Its Slurm controller's run ended ({controller.state}).")
        ended.append(worker.node)
    return ended
