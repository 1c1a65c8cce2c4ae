"""The pool orders administrators build across kinds of capacity (docs/scheduling.md, "Pool order across
owned, committed and rented capacity"), each played through several cycles of the engine: work arrives,
is placed, finishes, and more arrives."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.configuration.services import draft_provision, draft_save
from apps.resources.models import Pool as PoolRow
from apps.scheduling.cycle import run_cycle
from apps.scheduling.engine import Allocation, schedule
from apps.scheduling.engine.model import Pool
from apps.scheduling.models import Task, TaskState
from apps.scheduling.services import TaskRequest, tasks_submit
from tests.scheduling.builders import policy, pool, profile, queue, snapshot, task
from tests.scheduling.config import acme_document
from tests.world import World


@dataclass
class Cluster:
    """Pools, one policy with no reservation and a high limit, and the compute resources given: a queue
    per (name, profile)."""

    pools: list[Pool]
    profiles: dict[str, list[str]]
    running: dict[str, Allocation] = field(default_factory=dict)
    queued: dict[str, str] = field(default_factory=dict)  # task -> queue
    sizes: dict[str, int] = field(default_factory=dict)
    clock: float = 0.0

    def submit(self, queue_name: str, *names: str, gpus: int = 1) -> None:
        for name in names:
            self.clock += 1
            self.queued[name] = queue_name
            self.sizes[name] = gpus

    def finish(self, *names: str) -> None:
        for name in names:
            del self.running[name]

    def cycle(self) -> dict[str, str]:
        """One cycle: what was placed where (and is running from now)."""
        decision = schedule(
            snapshot(
                pools=self.pools,
                profiles=[profile(name, order) for name, order in self.profiles.items()],
                policies=[policy("team", 0, 10_000)],
                queues=[queue(name, "team", name) for name in self.profiles],
                queued=[
                    task(name, queue_name, self.sizes[name], at=order)
                    for order, (name, queue_name) in enumerate(self.queued.items())
                ],
                allocations=self.running.values(),
            )
        )
        placed = {placement.task: placement.pool for placement in decision.placements}
        for name, where in placed.items():
            queue_name = self.queued.pop(name)
            self.running[name] = Allocation(name, queue_name, where, self.sizes[name] * 840, self.clock)
        return placed

    def where(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for name, allocation in sorted(self.running.items()):
            found.setdefault(allocation.pool, []).append(name)
        return found


def test_owned_first_then_a_neocloud_then_on_demand_up_to_its_maximum() -> None:
    """Owned GPUs (4), a neocloud's (4), then on-demand cloud up to its maximum (2 instances of 4 GPUs: 8)."""
    cluster = Cluster(
        [pool("owned", 4), pool("neocloud", 4), pool("on-demand", 8)],
        {"train": ["owned", "neocloud", "on-demand"]},
    )
    cluster.submit("train", *[f"t{n:02}" for n in range(18)])
    cluster.cycle()
    where = cluster.where()
    assert (len(where["owned"]), len(where["neocloud"]), len(where["on-demand"])) == (4, 4, 8)
    assert where["owned"] == ["t00", "t01", "t02", "t03"]  # the first in line get the cheapest
    assert sorted(cluster.queued) == ["t16", "t17"]  # past the cloud's maximum, they wait


def test_committed_capacity_is_used_before_on_demand() -> None:
    """Reserved (committed, paid whether used or not) instances before on-demand ones of the same kind."""
    cluster = Cluster([pool("committed", 8), pool("on-demand", 16)], {"a100": ["committed", "on-demand"]})
    cluster.submit("a100", "a", "b", gpus=4)
    assert cluster.cycle() == {"a": "committed", "b": "committed"}
    cluster.submit("a100", "c", gpus=4)
    assert cluster.cycle() == {"c": "on-demand"}
    cluster.finish("a")
    cluster.submit("a100", "d", gpus=4)
    assert cluster.cycle() == {"d": "committed"}  # committed capacity that frees is used again first


def test_a_compute_resource_per_gpu_class_keeps_each_on_its_own_pools() -> None:
    cluster = Cluster(
        [pool("h100-owned", 8), pool("h100-cloud", 8), pool("a100-owned", 8)],
        {"H100 training": ["h100-owned", "h100-cloud"], "A100 inference": ["a100-owned"]},
    )
    cluster.submit("H100 training", "h1", "h2", "h3", gpus=4)
    cluster.submit("A100 inference", "a1", "a2", "a3", gpus=4)
    placed = cluster.cycle()
    assert {placed[name] for name in ("h1", "h2", "h3")} <= {"h100-owned", "h100-cloud"}
    assert {placed[name] for name in ("a1", "a2")} == {"a100-owned"}
    assert "a3" in cluster.queued  # A100 work never spills onto H100 capacity, and waits for its own


def test_spill_over_returns_to_owned_capacity_as_soon_as_it_frees() -> None:
    """Work spills to the cloud while owned GPUs are full; once they free, new work goes to them, never
    to the cloud while an owned GPU is free, so the cloud's instances go idle and end."""
    cluster = Cluster([pool("owned", 4), pool("cloud", 8)], {"train": ["owned", "cloud"]})
    cluster.submit("train", *[f"burst{n}" for n in range(8)])
    cluster.cycle()
    assert len(cluster.where()["cloud"]) == 4
    cluster.finish("burst0", "burst1")  # two owned GPUs free
    cluster.submit("train", "late0", "late1", "late2")
    placed = cluster.cycle()
    assert placed == {"late0": "owned", "late1": "owned", "late2": "cloud"}
    cluster.finish(*cluster.where()["cloud"])  # the cloud's work ends
    cluster.finish("burst2")
    cluster.submit("train", "next")
    assert cluster.cycle() == {"next": "owned"}
    assert "cloud" not in cluster.where()  # nothing left there: its instances end once idle


def test_spill_over_returns_to_owned_capacity_through_the_plane(world: World, db: None) -> None:
    """The same through the database and the cycle: a cloud pool online through its autoscaler (its
    heartbeat) takes the overflow; once an owned GPU frees, the next task goes there."""
    with schema_context("acme"):
        Task.objects.all().delete()
        alice, bob = User.objects.get(username="alice"), User.objects.get(username="bob")
        document = acme_document()
        document["pools"].append({"name": "burst", "environment": "cloud", "capacity_gpus": 16,
                                  "heartbeat_timeout_seconds": 90})  # fmt: skip
        document["profiles"][0]["pools"] = [{"pool": "baremetal"}, {"pool": "burst"}]
        draft_save(tenant=world.tenant_a, user=alice, document=document)
        draft_provision(tenant=world.tenant_a, user=alice)
        PoolRow.objects.filter(name="burst").update(
            last_heartbeat_at=timezone.now()
        )  # its autoscaler is there
        request = TaskRequest(compute_resource="Research: 4 GPUs", spec={"command": ["true"]})
        first = tasks_submit(tenant=world.tenant_a, user=bob, requests=[request] * 4)
        run_cycle(world.tenant_a)
        placed = Task.objects.filter(pk__in=[t.pk for t in first])
        where = dict(placed.values_list("pk", "pool__name"))
        assert sorted(where.values()) == ["baremetal", "baremetal", "burst", "burst"]
        owned = next(pk for pk, pool in where.items() if pool == "baremetal")
        Task.objects.filter(pk=owned).update(state=TaskState.COMPLETED, ended_at=timezone.now())
        (late,) = tasks_submit(tenant=world.tenant_a, user=bob, requests=[request])
        run_cycle(world.tenant_a)
        assert Task.objects.filter(pk=late.pk).values_list("pool__name", flat=True).get() == "baremetal"
