"""A Slurm cluster's workers (apps.catalogue.slurm): made as tasks when its controller's resume program
asks, with the controller run's task token, ended when its suspend program gives them back, when the app
stops and when the controller's run is over; a launch whose workers could not run is refused at once."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.catalogue import selectors, services, slurm
from apps.catalogue.models import AppInstance, ClusterWorker
from apps.core.errors import InvalidInput
from apps.fleet.credentials import task_token
from apps.scheduling.models import ENDED_STATES, Task, TaskState
from protocol import clusters, pods
from protocol.units import UNITS_PER_GPU
from tenants.models import Tenant
from tests.catalogue.test_clusters import kubernetes_only
from tests.world import HOST_A, World

pytestmark = pytest.mark.django_db

TEAM_SLURM: dict[str, Any] = {
    "name": "team-slurm",
    "version": "1",
    "kind": "cluster",
    "image": "registry.example/klique-slurm:22.05",
    "command": ["sh", "/var/run/klique/slurm/start", "controller", "--", "ttyd", "-p", "{port}", "bash"],
    "health": {"path": "/"},
    "gpus": "0",
    "cluster": {
        "service": "slurm", "workers": 4, "worker_gpus": 1, "worker_cpus": 8,
        "worker_compute_resource": "Research: Kubernetes 1 GPUs",
    },
}  # fmt: skip


def launched(world: World, **cluster: Any) -> tuple[AppInstance, Task, str]:
    """The cluster launched by bob and its controller running: the app, its task, its run's task token."""
    alice, bob = User.objects.get(username="alice"), User.objects.get(username="bob")
    document = {**TEAM_SLURM, "cluster": {**TEAM_SLURM["cluster"], **cluster}}
    services.entry_add(user=alice, document=document)
    kubernetes_only(1)  # the workers'
    app = services.app_launch(
        tenant=world.tenant_a,
        user=bob,
        entry="team-slurm",
        compute_resource=kubernetes_only(0),
        project="apollo",
    )
    Task.objects.filter(pk=str(app.task_id)).update(state=TaskState.RUNNING, lease_id=uuid.uuid4())
    task = Task.objects.get(pk=str(app.task_id))
    return app, task, task_token(schema_name=world.tenant_a.schema_name, task=task)


def ask(task: Task, token: str | None, body: Any) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return Client().post(
        f"/agents/v1/tasks/{task.pk}/slurm/",
        data=body if isinstance(body, str) else json.dumps(body),
        content_type="application/json",
        HTTP_HOST=HOST_A,
        headers=headers,
    )


def nodes(task: Task) -> list[str]:
    job = pods.job_name(str(task.pk), str(task.lease_id))
    return clusters.slurm_nodes(job, clusters.ClusterService.parse(task.spec["app"]["cluster"]))


def live(app: AppInstance) -> dict[str, Task]:
    workers = (
        ClusterWorker.objects.filter(app=app).exclude(task__state__in=ENDED_STATES).select_related("task")
    )
    return {worker.node: worker.task for worker in workers}


def test_nodes_slurm_wakes_become_worker_tasks_and_those_it_gives_back_end(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        app, controller, token = launched(world)
        names = nodes(controller)
        cluster = names[0].rpartition("-w")[0]
        answer = ask(controller, token, {"resume": f"{cluster}-w[0-1]"})
        assert answer.status_code == 200, answer.content
        assert answer.json() == {"made": names[:2], "kept": [], "ended": [], "refused": {}}
        workers = live(app)
        assert sorted(workers) == names[:2]
        worker = workers[names[0]]
        assert (worker.state, worker.size_units, worker.submitter.username) == (
            TaskState.QUEUED,
            UNITS_PER_GPU,
            "bob",
        )
        assert worker.project_id == controller.project_id
        assert worker.compute_resource is not None
        assert worker.compute_resource.name == "Research: Kubernetes 1 GPUs"
        assert controller.size_units == 0  # the controller holds no GPU
        assert worker.max_attempts == 1
        assert worker.spec["image"] == TEAM_SLURM["image"]
        assert worker.spec["command"] == [
            "sh",
            "/var/run/klique/slurm/start",
            "worker",
            names[0],
            f"{cluster}-ctld",
        ]
        section = clusters.SlurmWorker.parse(worker.spec["slurm_worker"])
        assert (section.controller, section.lease) == (str(controller.pk), str(controller.lease_id))
        assert section.secret == f"{pods.job_name(str(controller.pk), str(controller.lease_id))}-slurm"
        assert section.cpus == 8

        # Asked again (slurmctld retries), nothing more is made.
        again = ask(controller, token, {"resume": f"{cluster}-w[0-2]"})
        assert again.json() == {"made": names[2:3], "kept": names[:2], "ended": [], "refused": {}}
        assert len(live(app)) == 3

        # The reconciler reads the nodes with a worker task, as text for its shell.
        read = Client().get(f"/agents/v1/tasks/{controller.pk}/slurm/", HTTP_HOST=HOST_A,
                            headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        assert (read.status_code, read["Content-Type"]) == (200, "text/plain")
        assert read.content.decode() == " ".join(names[:3])

        # Given back: its task ends, saying why; woken again, a new task runs it.
        given = ask(controller, token, {"suspend": names[0]})
        assert given.json()["ended"] == [names[0]]
        ended = Task.objects.get(pk=worker.pk)
        assert ended.state == TaskState.ABORTED
        idle = "idle for 300 s, or not up within 60 minutes (its resume timeout)"
        assert ended.reason == f"Slurm gave {names[0]} back: {idle}."
        woken = ask(controller, token, {"resume": names[0]})
        assert woken.json()["made"] == [names[0]]
        assert live(app)[names[0]].pk != worker.pk

        # The app stops: every worker ends with it.
        services.app_stop(tenant=world.tenant_a, user=User.objects.get(username="bob"), app=app)
        assert live(app) == {}
        reasons = {
            task.reason for task in Task.objects.filter(cluster_worker__app=app, reason__contains="stopped")
        }
        assert reasons == {f"Its Slurm cluster {app.name} stopped: Stopped by bob."}


@pytest.mark.parametrize("how", ["failed", "preempted", "lease"])
def test_workers_of_a_controller_run_that_is_over_are_ended_by_the_sweep(world: World, how: str) -> None:
    with schema_context(world.tenant_a.schema_name):
        app, controller, token = launched(world)
        first, second = nodes(controller)[:2]
        assert ask(controller, token, {"resume": first}).status_code == 200
        assert slurm.workers_sweep(tenant=world.tenant_a) == []  # its controller runs: kept
        changes: dict[str, dict[str, Any]] = {
            "failed": {"state": TaskState.FAILED},
            "preempted": {"state": TaskState.QUEUED, "lease_id": None},
            "lease": {"lease_id": uuid.uuid4()},  # started again: another run
        }
        change = changes[how]
        Task.objects.filter(pk=controller.pk).update(**change)
        assert slurm.workers_sweep(tenant=world.tenant_a) == [first]
        assert live(app) == {}
        assert Task.objects.get(cluster_worker__node=first).reason.startswith(
            "Its Slurm controller's run ended"
        )
        assert slurm.workers_sweep(tenant=world.tenant_a) == []
        # The old run's token is dead with it, for its reconciler too.
        assert ask(controller, token, {"resume": second}).status_code == 403
        gone = Client().get(f"/agents/v1/tasks/{controller.pk}/slurm/", HTTP_HOST=HOST_A,
                            headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        assert gone.status_code == 403


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ("not json", 400, "Send {"),
        ([], 400, "Send {"),
        ({}, 400, "Send {"),
        ({"resume": "x", "colour": "red"}, 400, "Send {"),
        ({"resume": 3}, 400, "host list"),
        ({"resume": "vc-other-cluster-w0"}, 400, "not a node of this cluster"),
        ({"resume": "{cluster}-w[0-9]"}, 400, "not a node of this cluster"),  # beyond its 4 workers
        ({"resume": "{cluster}-w[0-100000]"}, 400, "more than 64 hosts"),
        ({"suspend": "$(id)"}, 400, "not a Slurm host list"),
        ({"resume": "a;b"}, 400, "not a Slurm host list"),
    ],
)
def test_what_is_not_a_request_for_this_clusters_nodes_is_refused(
    world: World, body: Any, status: int, words: str
) -> None:
    with schema_context(world.tenant_a.schema_name):
        app, controller, token = launched(world)
        cluster = nodes(controller)[0].rpartition("-w")[0]
        if isinstance(body, dict):
            body = {key: value.replace("{cluster}", cluster) if isinstance(value, str) else value
                    for key, value in body.items()}  # fmt: skip
        answer = ask(controller, token, body)
        assert answer.status_code == status, answer.content
        assert words in answer.json()["detail"]
        assert live(app) == {}


def test_only_the_controller_runs_own_token_opens_it(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        app, controller, token = launched(world)
        body = {"resume": nodes(controller)[0]}
        assert ask(controller, None, body).status_code == 401
        assert Client().get(f"/agents/v1/tasks/{controller.pk}/slurm/", HTTP_HOST=HOST_A).status_code == 401
        assert (
            ask(controller, world.tokens["bob"], body).status_code == 401
        )  # a user's token opens nothing here
        forged = token[:-4] + ("aaaa" if not token.endswith("aaaa") else "bbbb")
        assert ask(controller, forged, body).status_code == 403
        # Another task's token, for this task's address.
        other = services.app_launch(
            tenant=world.tenant_a, user=User.objects.get(username="bob"), entry="team-slurm",
            compute_resource=app.compute_resource_name,
        )  # fmt: skip
        Task.objects.filter(pk=str(other.task_id)).update(state=TaskState.RUNNING, lease_id=uuid.uuid4())
        other_token = task_token(
            schema_name=world.tenant_a.schema_name, task=Task.objects.get(pk=str(other.task_id))
        )
        assert ask(controller, other_token, body).status_code == 403
        # A task that is no Slurm controller.
        Task.objects.filter(pk=controller.pk).update(spec={"command": ["true"]})
        plain = Task.objects.get(pk=controller.pk)
        assert (
            ask(plain, task_token(schema_name=world.tenant_a.schema_name, task=plain), body).status_code
            == 404
        )
        assert live(app) == {}


def test_a_worker_the_scheduler_refuses_is_said_and_the_others_are_made(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        app, controller, token = launched(world)
        Tenant.objects.filter(pk=world.tenant_a.pk).update(gpu_share=0)  # the tenant may hold no GPU now
        answer = ask(controller, token, {"resume": nodes(controller)[0]})
        assert answer.status_code == 409
        assert "above the tenant's GPU share" in answer.json()["refused"][nodes(controller)[0]]
        assert live(app) == {}


@pytest.mark.parametrize(
    ("cluster", "words"),
    [
        ({"worker_compute_resource": "Research: 4 GPUs"}, "also places work on baremetal"),
        ({"worker_compute_resource": "No such resource"}, "The cluster's workers run on No such resource"),
        ({"worker_gpus": 2}, "Each worker of this Slurm cluster is a task of 2 whole GPUs"),
        ({"worker_compute_resource": "Research: MIG slice"}, "Each worker of this Slurm cluster"),
        ({"worker_gpus": 16}, "Each worker of this Slurm cluster is a task of 16 whole GPUs"),
        ({"share": 0}, "above the tenant's GPU share of 0"),  # such a worker could never run
    ],
)
def test_a_cluster_whose_workers_could_not_run_is_refused_at_launch(
    world: World, cluster: dict[str, Any], words: str
) -> None:
    with schema_context(world.tenant_a.schema_name):
        alice, bob = User.objects.get(username="alice"), User.objects.get(username="bob")
        if "share" in cluster:  # (the tenant as the request would read it; the world's stays as it is)
            Tenant.objects.filter(pk=world.tenant_a.pk).update(gpu_share=cluster.pop("share"))
        tenant = Tenant.objects.get(pk=world.tenant_a.pk)
        services.entry_add(
            user=alice, document={**TEAM_SLURM, "cluster": {**TEAM_SLURM["cluster"], **cluster}}
        )
        kubernetes_only(1)
        resource = kubernetes_only(0)
        apps, tasks = AppInstance.objects.count(), Task.objects.count()
        with pytest.raises(InvalidInput) as refused:
            services.app_launch(tenant=tenant, user=bob, entry="team-slurm", compute_resource=resource)
        assert words in str(refused.value)
        assert (AppInstance.objects.count(), Task.objects.count()) == (apps, tasks)
        with pytest.raises(InvalidInput, match="also places work on baremetal"):  # the controller's own
            services.app_launch(
                tenant=tenant, user=bob, entry="team-slurm", compute_resource="Research: 4 GPUs"
            )


def test_the_shipped_entry_is_launched_with_its_workers_on_the_compute_resource_the_launch_chose(
    world: World,
) -> None:
    with schema_context(world.tenant_a.schema_name):
        bob = User.objects.get(username="bob")
        controller, workers = kubernetes_only(0), kubernetes_only(1)
        with pytest.raises(InvalidInput, match="Each worker of this Slurm cluster is a task of 1 whole GPUs"):
            services.app_launch(tenant=world.tenant_a, user=bob, entry="slurm", compute_resource=controller)
        app = services.app_launch(
            tenant=world.tenant_a, user=bob, entry="slurm", compute_resource=controller,
            worker_compute_resource=workers,
        )  # fmt: skip
        task = Task.objects.get(pk=str(app.task_id))
        assert task.spec["app"]["cluster"]["worker_compute_resource"] == workers
        assert app.template["cluster"]["worker_compute_resource"] == workers  # as launched, kept
        with pytest.raises(InvalidInput, match="makes no Slurm cluster") as refused:
            services.app_launch(
                tenant=world.tenant_a, user=bob, entry="jupyterlab", compute_resource=controller,
                worker_compute_resource=workers,
            )  # fmt: skip
        assert refused.value.field == "worker_compute_resource"


def test_a_launch_through_the_api_names_the_workers_compute_resource(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        controller, workers = kubernetes_only(0), kubernetes_only(1)
    answer = Client().post(
        "/api/v1/apps/",
        data=json.dumps(
            {"entry": "slurm", "compute_resource": controller, "worker_compute_resource": workers}
        ),
        content_type="application/json",
        HTTP_HOST=HOST_A,
        headers={"Authorization": f"Bearer {world.tokens['bob']}"},
    )
    assert answer.status_code == 201, answer.content
    with schema_context(world.tenant_a.schema_name):
        app = AppInstance.objects.get(pk=answer.json()["id"])
        assert app.template["cluster"]["worker_compute_resource"] == workers


def test_a_clusters_gpu_time_is_its_workers(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        app, controller, token = launched(world)
        first, second = nodes(controller)[:2]
        assert ask(controller, token, {"resume": f"{first},{second}"}).status_code == 200
        now = timezone.now()
        for node, minutes in ((first, 30), (second, 90)):  # two workers of 1 GPU, running so long
            Task.objects.filter(cluster_worker__node=node).update(
                state=TaskState.RUNNING, started_at=now - timedelta(minutes=minutes), metered_until=None
            )
        other = services.app_launch(
            tenant=world.tenant_a, user=User.objects.get(username="bob"), entry="team-slurm",
            compute_resource=app.compute_resource_name,
        )  # fmt: skip
        usage = selectors.apps_usage([app, other], now)
        assert usage[app.pk]["gpu_hours"] == Decimal(2)  # half an hour and an hour and a half
        assert usage[other.pk]["gpu_hours"] == Decimal(0)  # another cluster's workers are not its
