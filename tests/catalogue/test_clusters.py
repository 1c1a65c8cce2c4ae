"""Clustering services at launch: a cluster is made on Kubernetes pools only, as one app of whole GPUs on
one node that its workers split evenly; a launch that could not run says so at once, and nothing is made."""

from __future__ import annotations

from typing import Any

import pytest
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.catalogue import services
from apps.catalogue.models import AppInstance
from apps.core.errors import InvalidInput
from apps.resources.models import ComputeResource, Pool, ProfilePool, ResourcePolicy, ResourceProfile
from apps.scheduling.models import Task
from protocol.units import UNITS_PER_GPU
from tests.world import World

pytestmark = pytest.mark.django_db

TEAM_CLUSTER: dict[str, Any] = {
    "name": "team-cluster",
    "version": "1",
    "kind": "cluster",
    "command": ["kubectl", "proxy", "--address=127.0.0.1", "--port={port}"],
    "health": {"path": "/version"},
    "gpus": "2",
    "cluster": {"service": "k3k", "agents": 2},
}


def kubernetes_only(gpus: int) -> str:
    """A compute resource of `gpus` whole GPUs whose one pool is the Kubernetes pool h100."""
    profile = ResourceProfile.objects.create(name=f"k8s-{gpus}", size_units=gpus * UNITS_PER_GPU)
    ProfilePool.objects.create(profile=profile, pool=Pool.objects.get(name="h100"), position=0)
    name = f"Research: Kubernetes {gpus} GPUs"
    ComputeResource.objects.create(
        name=name, policy=ResourcePolicy.objects.get(name="research"), profile=profile
    )
    return name


def launch(world: World, entry: str, resource: str, **options: Any) -> AppInstance:
    user = User.objects.get(username="bob")
    return services.app_launch(
        tenant=world.tenant_a, user=user, entry=entry, compute_resource=resource, **options
    )


def test_a_cluster_on_kubernetes_pools_is_launched_with_its_cluster_in_the_tasks_spec(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        services.entry_add(user=User.objects.get(username="alice"), document=TEAM_CLUSTER)
        app = launch(world, "team-cluster", kubernetes_only(2))
        task = Task.objects.get(pk=str(app.task_id))
        assert task.spec["app"]["cluster"]["agents"] == 2
        assert task.spec["app"]["cluster"]["service"] == "k3k"
        assert task.size_units == 2 * UNITS_PER_GPU
        shipped = launch(world, "k3k", kubernetes_only(1))
        assert Task.objects.get(pk=str(shipped.task_id)).spec["app"]["cluster"] == {
            "service": "k3k", "servers": 1, "agents": 1, "version": "", "persistence": "ephemeral"
        }  # fmt: skip


@pytest.mark.parametrize(
    ("resource", "field", "words"),
    [
        ("Research: 4 GPUs", "compute_resource", "also places work on baremetal (baremetal)"),
        ("Research: multi-node training", "compute_resource", "gives 2 nodes, 8 GPUs"),
        ("Research: MIG slice", "compute_resource", "one app of whole GPUs on one compute resource"),
        ("Research: shared GPU", "compute_resource", "one app of whole GPUs on one compute resource"),
        ("k8s:3", "gpus", "split over its 2 agents in whole GPUs; 3 is not"),
    ],
)
def test_a_cluster_that_could_not_run_there_is_refused_at_launch_and_nothing_is_made(
    world: World, resource: str, field: str, words: str
) -> None:
    with schema_context(world.tenant_a.schema_name):
        services.entry_add(user=User.objects.get(username="alice"), document=TEAM_CLUSTER)
        if resource.startswith("k8s:"):
            resource = kubernetes_only(int(resource[4:]))
        apps, tasks = AppInstance.objects.count(), Task.objects.count()
        with pytest.raises(InvalidInput) as refused:
            launch(world, "team-cluster", resource, gpus="2")
        assert words in str(refused.value)
        assert refused.value.field == field
        assert (AppInstance.objects.count(), Task.objects.count()) == (apps, tasks)
