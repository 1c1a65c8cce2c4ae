"""The autoscaler's decisions, against moto's EC2 through the real boto3 client, with the plane played by a
small double that keeps the plane's side of protocol.cloud (mint, handoff, the fleet view) and a clock the
test moves. The whole path through a real plane and real instance agents is tests/e2e/test_cloud.py."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from agents.cloud.autoscaler import Autoscaler
from agents.cloud.ec2 import Ec2
from agents.cloud.plane import PlaneError
from agents.cloud.providers import ProviderError, Seen
from agents.cloud.settings import CloudSettings
from agents.state import State
from protocol import cloud
from protocol.units import UNITS_PER_GPU
from tests.cloud.conftest import REGION, an_image, ec2_client


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class PlaneDouble:
    """The plane's side: runs handed to instances, which instance agents are connected, what was reported."""

    clock: Clock
    url: str = "http://demo.localhost:8000"
    minted: dict[str, str] = field(default_factory=dict)
    on: dict[str, dict[str, cloud.FleetRun]] = field(default_factory=dict)  # instance -> task -> run
    connected: set[str] = field(default_factory=set)
    stale: set[str] = field(default_factory=set)  # tasks whose autoscaler lease is no longer live
    units: dict[str, int] = field(default_factory=dict)
    reported: dict[str, cloud.Instance] = field(default_factory=dict)
    handoffs: list[cloud.Handoff] = field(default_factory=list)

    async def mint(self, name: str, seconds: float) -> cloud.Minted:
        self.minted[name] = f"kqa_{secrets.token_hex(4)}_{secrets.token_urlsafe(12)}"
        return cloud.Minted(self.minted[name], self.clock() + seconds)

    async def handoff(self, handoff: cloud.Handoff) -> cloud.Handed:
        if handoff.task_id in self.stale:
            raise PlaneError("the plane answered 409: no live lease", status=409)
        lease = str(uuid.uuid4())
        run = cloud.FleetRun(handoff.task_id, lease, self.units[handoff.task_id])
        self.on.setdefault(handoff.agent_id, {})[handoff.task_id] = run
        self.handoffs.append(handoff)
        return cloud.Handed(lease, self.clock())

    async def report(self, instances: list[cloud.Instance]) -> cloud.FleetView:
        for instance in instances:
            self.reported[instance.name] = instance
        live = [name for name, instance in self.reported.items() if instance.state not in cloud.ENDED]
        agents = tuple(
            cloud.FleetAgent(name, name in self.connected, tuple(self.on.get(name, {}).values()))
            for name in live
        )
        return cloud.FleetView(self.clock(), agents)

    def finish(self, task_id: str) -> None:
        for runs in self.on.values():
            runs.pop(task_id, None)


@dataclass
class Scaling:
    scaler: Autoscaler
    plane: PlaneDouble
    clock: Clock
    ec2: Any
    reports: list[tuple[str, str, dict[str, Any]]]
    work_dir: Path

    async def assign(self, task_id: str, gpus: int = 1) -> None:
        units = gpus * UNITS_PER_GPU
        self.plane.units[task_id] = units
        lease = str(uuid.uuid4())
        self.scaler.state.lease_begin(task_id, lease, 1)  # as the agent loop does before start
        assignment = {
            "task_id": task_id,
            "lease_id": lease,
            "size_units": units,
            "nodes": 1,
            "sharing": "whole",
        }
        await self.scaler.start(assignment, self.report)

    async def report(self, task_id: str, kind: str, body: dict[str, Any], offset: Any = None) -> None:
        self.reports.append((task_id, kind, body))

    def running(self) -> list[str]:
        reservations = self.ec2.describe_instances(
            Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}]
        )["Reservations"]
        return sorted(
            instance["InstanceId"] for reservation in reservations for instance in reservation["Instances"]
        )

    def restart(self, **changes: Any) -> Autoscaler:
        """The autoscaler process again, from its work folder, with the same provider and plane."""
        old = self.scaler
        self.scaler = Autoscaler(
            changes.get("settings", old.settings), State(self.work_dir / "agent.sqlite"), old.provider,
            self.work_dir, old.agent_id, gpus_per_instance=old.gpus_per_instance, clock=self.clock,
        )  # fmt: skip
        self.scaler.plane = self.plane  # type: ignore[assignment]
        self.scaler.adopt(self.report)
        return self.scaler


def settings(image: str, **changes: Any) -> CloudSettings:
    section: dict[str, Any] = {
        "region": REGION,
        "image": image,
        "instance_type": "g5.12xlarge",  # 4 GPUs
        "max_instances": 3,
        "idle_timeout_seconds": 300,
        "boot_timeout_seconds": 600,
    }
    section.update(changes)
    return CloudSettings.read({"agent": {"cloud": section}})


@pytest.fixture
def scaling(aws: str, tmp_path: Path) -> Scaling:
    clock = Clock()
    provider = Ec2(REGION, aws)
    scaler = Autoscaler(
        settings(an_image(aws)), State(tmp_path / "agent.sqlite"), provider, tmp_path, "scaler",
        gpus_per_instance=4, clock=clock,
    )  # fmt: skip
    plane = PlaneDouble(clock)
    scaler.plane = plane  # type: ignore[assignment]
    built = Scaling(scaler, plane, clock, ec2_client(aws), [], tmp_path)
    scaler.adopt(built.report)
    return built


def test_tasks_on_an_empty_pool_start_instances_up_to_the_maximum_and_no_more(scaling: Scaling) -> None:
    async def burst() -> None:
        # Twenty 4-GPU tasks arrive at once, while passes run: each needs a whole instance; at most 3 exist.
        await asyncio.gather(*(scaling.assign(f"task-{number:02}", gpus=4) for number in range(20)),
                             scaling.scaler.tick(), scaling.scaler.tick())  # fmt: skip
        await scaling.scaler.tick()

    asyncio.run(burst())
    assert len(scaling.running()) == 3
    assert len(scaling.plane.handoffs) == 3
    assert len(scaling.scaler.waiting) == 17
    waiting = [body for _, kind, body in scaling.reports if kind == "status"]
    assert waiting
    assert "all 3 instances (the pool's maximum) are busy" in waiting[0]["reason"]
    # Each instance got its own token, in its own user data, with its name as its agent id.
    assert set(scaling.plane.minted) == set(scaling.plane.on)
    for name, _token in scaling.plane.minted.items():
        (machine,) = [m for m in scaling.scaler.machines.values() if m.name == name]
        script = scaling.ec2.describe_instance_attribute(InstanceId=machine.provider_id, Attribute="userData")
        assert script["UserData"]["Value"]  # base64 of the bootstrap script
    # A finished task frees its instance for the next waiting one: no fourth instance.
    first = scaling.plane.handoffs[0]
    scaling.plane.finish(first.task_id)
    scaling.clock.now += 5
    asyncio.run(scaling.scaler.tick())
    assert len(scaling.running()) == 3
    assert len(scaling.plane.handoffs) == 4
    assert scaling.plane.handoffs[3].agent_id == first.agent_id


def test_small_tasks_share_an_instance(scaling: Scaling) -> None:
    async def arrive() -> None:
        for number in range(6):
            await scaling.assign(f"small-{number}", gpus=1)
        await scaling.scaler.tick()

    asyncio.run(arrive())
    placed = {handoff.task_id: handoff.agent_id for handoff in scaling.plane.handoffs}
    assert len(placed) == 6
    assert len(set(placed.values())) == 2
    assert len(scaling.running()) == 2


def test_an_idle_instance_ends_after_its_timeout_and_not_before(scaling: Scaling) -> None:
    asyncio.run(scaling.assign("only", gpus=2))
    asyncio.run(scaling.scaler.tick())
    (name,) = scaling.plane.on
    scaling.plane.connected.add(name)
    scaling.clock.now += 30
    asyncio.run(scaling.scaler.tick())
    scaling.plane.finish("only")
    scaling.clock.now += 1
    asyncio.run(scaling.scaler.tick())  # idle from here
    idle_from = scaling.clock.now
    scaling.clock.now = idle_from + 299
    asyncio.run(scaling.scaler.tick())
    assert len(scaling.running()) == 1, "ended before its idle timeout"
    assert scaling.plane.reported[name].state == cloud.IDLE
    scaling.clock.now = idle_from + 300
    asyncio.run(scaling.scaler.tick())
    assert scaling.running() == []
    asyncio.run(scaling.scaler.tick())
    assert scaling.plane.reported[name].state == cloud.STOPPED
    assert "idle for 300 s" in scaling.plane.reported[name].reason
    assert name not in scaling.scaler.machines  # forgotten once the plane heard of its end


def test_an_instance_that_takes_a_task_at_the_moment_it_would_end_is_kept(scaling: Scaling) -> None:
    asyncio.run(scaling.assign("first"))
    asyncio.run(scaling.scaler.tick())
    (name,) = scaling.plane.on
    scaling.plane.connected.add(name)
    scaling.plane.finish("first")
    asyncio.run(scaling.scaler.tick())
    scaling.clock.now += 300  # its idle timeout is reached in this very pass ...
    asyncio.run(scaling.assign("second"))  # ... and a task arrives for it
    asyncio.run(scaling.scaler.tick())
    assert len(scaling.running()) == 1
    assert scaling.plane.handoffs[-1] == cloud.Handoff(
        "second", scaling.plane.handoffs[-1].lease_id, name, 120.0
    )
    assert scaling.plane.reported[name].state == cloud.BUSY


def test_a_view_older_than_a_handoff_does_not_make_the_instance_idle(scaling: Scaling) -> None:
    """The plane's view of an instance without a task it was just handed must be older than the handoff:
    the task stays counted, and the instance is not ended under it."""
    asyncio.run(scaling.assign("fresh"))
    asyncio.run(scaling.scaler.tick())
    (name,) = scaling.plane.on
    scaling.plane.connected.add(name)
    stale_view = cloud.FleetView(scaling.clock.now - 1, (cloud.FleetAgent(name, True, ()),))
    scaling.scaler._follow(stale_view, scaling.clock.now + 400)
    assert "fresh" in scaling.scaler.machines[name].slots
    scaling.clock.now += 400
    asyncio.run(scaling.scaler._scale_in(scaling.clock.now))
    assert len(scaling.running()) == 1


def test_a_restarted_autoscaler_adopts_its_instances_and_starts_none_twice(scaling: Scaling) -> None:
    async def arrive() -> None:
        for number in range(5):
            await scaling.assign(f"t{number}", gpus=4)
        await scaling.scaler.tick()

    asyncio.run(arrive())
    assert len(scaling.running()) == 3
    for name in scaling.plane.on:
        scaling.plane.connected.add(name)
    before = set(scaling.running())
    scaling.restart()
    asyncio.run(scaling.scaler.tick())
    assert set(scaling.running()) == before
    assert len(scaling.scaler.waiting) == 2  # still waiting for room, not launched for again
    # Even with its notes lost, its instances are found by their tags, with the tasks the plane says they run.
    (scaling.work_dir / "cloud.json").unlink()
    scaling.restart()
    asyncio.run(scaling.scaler.tick())
    assert set(scaling.running()) == before
    assert sorted(len(machine.slots) for machine in scaling.scaler.machines.values()) == [1, 1, 1]


def test_an_instance_the_listing_does_not_show_yet_is_not_taken_for_gone(scaling: Scaling) -> None:
    """EC2's listing is eventually consistent: right after a launch it may not show the instance. Only
    an instance missing past the grace period is taken for gone (and reported interrupted)."""
    asyncio.run(scaling.assign("t"))
    asyncio.run(scaling.scaler.tick())
    (name,) = scaling.plane.on
    real_instances = scaling.scaler.provider.instances
    scaling.scaler.provider.instances = lambda tags: []  # type: ignore[method-assign]
    scaling.clock.now += 60
    asyncio.run(scaling.scaler.tick())
    assert scaling.plane.reported[name].state == cloud.BOOTING
    scaling.clock.now += 200
    asyncio.run(scaling.scaler.tick())
    assert scaling.plane.reported[name].state == cloud.INTERRUPTED
    assert "no longer lists it" in scaling.plane.reported[name].reason
    scaling.scaler.provider.instances = real_instances  # type: ignore[method-assign]


def test_a_launch_the_autoscaler_died_in_is_adopted_not_repeated(scaling: Scaling) -> None:
    """Noted, then launched, then the process dies before noting the provider's id: the restart finds the
    instance by its name tag."""
    asyncio.run(scaling.assign("t"))
    real_launch = scaling.scaler.provider.launch

    def launch_then_die(launch: Any) -> str:
        real_launch(launch)
        raise KeyboardInterrupt  # the process dies right after the provider started it

    scaling.scaler.provider.launch = launch_then_die  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(scaling.scaler.tick())
    scaling.restart()
    asyncio.run(scaling.scaler.tick())
    assert len(scaling.running()) == 1
    assert len(scaling.plane.handoffs) == 1


def test_an_instance_the_cloud_takes_back_is_reported_interrupted(scaling: Scaling) -> None:
    asyncio.run(scaling.assign("spot-task"))
    asyncio.run(scaling.scaler.tick())
    (name,) = scaling.plane.on
    machine = scaling.scaler.machines[name]
    scaling.ec2.terminate_instances(InstanceIds=[machine.provider_id])  # the cloud reclaims it
    asyncio.run(scaling.scaler.tick())
    assert scaling.plane.reported[name].state == cloud.INTERRUPTED
    assert "the provider ended it" in scaling.plane.reported[name].reason


def test_an_instance_given_its_interruption_notice_is_reported_interrupted_while_it_still_runs(
    scaling: Scaling,
) -> None:
    asyncio.run(scaling.assign("spot-task"))
    asyncio.run(scaling.scaler.tick())
    (name,) = scaling.plane.on
    listing = scaling.scaler.provider.instances
    notice = "the cloud announced it will reclaim it (marked-for-termination: in two minutes)"

    def with_notice(tags: Mapping[str, str]) -> list[Seen]:  # EC2's notice, as Ec2.instances reads it
        return [replace(item, interruption=notice) if item.name == name else item for item in listing(tags)]

    scaling.scaler.provider.instances = with_notice  # type: ignore[method-assign]
    asyncio.run(scaling.scaler.tick())
    assert scaling.plane.reported[name].state == cloud.INTERRUPTED
    assert scaling.plane.reported[name].reason == notice
    assert len(scaling.running()) == 1  # still there: its agent gets the preemption and its grace period
    asyncio.run(scaling.assign("next-task"))
    asyncio.run(scaling.scaler.tick())
    assert len(scaling.running()) == 2  # the next task gets a new instance, not the one going away


def test_a_handoff_the_plane_calls_stale_lets_the_task_go(scaling: Scaling) -> None:
    asyncio.run(scaling.assign("aborted"))
    scaling.plane.stale.add("aborted")
    asyncio.run(scaling.scaler.tick())
    assert scaling.scaler.waiting == {}
    assert scaling.scaler.running() == []
    assert scaling.scaler.state.lease("aborted") == ""


def test_a_lasting_refusal_gives_the_tasks_back_and_stops_launches_until_fixed(
    scaling: Scaling, aws: str
) -> None:
    scaling.scaler.settings = settings("ami-0000dead")  # an image that does not exist
    asyncio.run(scaling.assign("a"))
    asyncio.run(scaling.assign("b"))
    asyncio.run(scaling.scaler.tick())
    given_back = [(task, body) for task, kind, body in scaling.reports if kind == "result"]
    assert [task for task, _ in given_back] == ["a", "b"]
    assert all(
        body["requeue"] is True and "InvalidAMIID.NotFound" in body["reason"] for _, body in given_back
    )
    assert "set [agent.cloud] image" in scaling.scaler.problem
    assert scaling.running() == []
    with pytest.raises(Exception, match="No instance can be started now"):
        asyncio.run(scaling.assign("c"))
    # Fixed (the image exists again): the next check after its retry time clears the problem.
    scaling.scaler.settings = settings(an_image(aws))
    scaling.clock.now += 61
    asyncio.run(scaling.scaler.tick())
    assert scaling.scaler.problem == ""


def test_a_transient_refusal_is_tried_again_later(scaling: Scaling) -> None:
    refusals = [ProviderError("quota", "EC2 refused to start a g5.12xlarge instance: InstanceLimitExceeded")]
    real_launch = scaling.scaler.provider.launch

    def refusing(launch: Any) -> str:
        if refusals:
            raise refusals.pop()
        return real_launch(launch)

    scaling.scaler.provider.launch = refusing  # type: ignore[method-assign]
    asyncio.run(scaling.assign("q"))
    asyncio.run(scaling.scaler.tick())
    assert "InstanceLimitExceeded" in scaling.scaler.problem
    assert [task for task, kind, _ in scaling.reports if kind == "result"] == ["q"]  # back to the queue
    scaling.clock.now += 301
    asyncio.run(scaling.scaler.tick())
    assert scaling.scaler.problem == ""
    asyncio.run(scaling.assign("r"))
    asyncio.run(scaling.scaler.tick())
    assert len(scaling.running()) == 1


@pytest.mark.parametrize(
    ("assignment", "said"),
    [
        ({"size_units": 5 * UNITS_PER_GPU}, "needs 5 GPUs and a g5.12xlarge instance has 4"),
        ({"nodes": 2}, "multi-node task"),
        ({"sharing": "mig"}, "MIG"),
    ],
)
def test_work_no_instance_could_run_is_refused_for_good(
    scaling: Scaling, assignment: dict[str, Any], said: str
) -> None:
    from agents.backend import Refused

    whole = {
        "task_id": "x",
        "lease_id": "l",
        "size_units": UNITS_PER_GPU,
        "nodes": 1,
        "sharing": "whole",
        **assignment,
    }
    with pytest.raises(Refused, match=said) as refused:
        asyncio.run(scaling.scaler.start(whole, scaling.report))
    assert refused.value.permanent
