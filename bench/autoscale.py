"""A burst of 500 one-GPU tasks on an empty cloud pool of at most 50 one-GPU instances: time from the first
submit to 50 instances running and to the last task done, and instance-hours spent over the GPU-hours used
(the idle overhead), beside an oracle that knows the burst in advance, in the same run.

Klique: the real autoscaler (agents/cloud/autoscaler.py) against moto's EC2 through boto3, in virtual time
(its clock is the benchmark's), with the plane's side played here: the scheduler places at most the
pool's capacity (50 GPUs) of the queue at once, in submit order, and hands the autoscaler the next task as
soon as one ends; an instance's agent says hello `--boot` seconds after its launch, takes what was handed
to it and runs each task for `--minutes`. The oracle starts exactly 50 instances at the first submit, runs
ten tasks back to back on each, and ends each the moment its last task ends.

Usage: .venv/bin/python bench/autoscale.py [--tasks 500] [--max 50] [--minutes 30] [--boot 120]
    [--idle 600]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from scratch import ROOT

sys.path.insert(0, str(ROOT))

from agents.cloud.autoscaler import Autoscaler
from agents.cloud.ec2 import Ec2
from agents.cloud.settings import CloudSettings
from agents.state import State
from protocol import cloud
from protocol.units import UNITS_PER_GPU
from tests.cloud.conftest import start_moto  # moto's server, as the tests start it
from tests.cloud.test_autoscaler import Clock  # a clock the simulation moves

REGION = "us-east-1"
STEP = 10.0  # virtual seconds between the simulation's looks (the autoscaler's tick)


@dataclass
class Plane:
    """The plane's side of protocol.cloud, and the scheduler, for one cloud pool."""

    clock: Clock
    capacity: int
    boot: float
    minutes: float
    url: str = "http://bench.localhost:8000"
    queue: list[str] = field(default_factory=list)  # submitted, not yet placed
    on: dict[str, dict[str, cloud.FleetRun]] = field(default_factory=dict)  # instance -> task -> run
    started: dict[str, float] = field(default_factory=dict)  # task -> when it started running
    launched: dict[str, float] = field(default_factory=dict)  # instance -> when it was first reported
    ended: dict[str, float] = field(default_factory=dict)  # instance -> when it was reported ended
    done: dict[str, float] = field(default_factory=dict)
    placed: int = 0  # tasks handed to the autoscaler and not ended

    async def mint(self, name: str, seconds: float) -> cloud.Minted:
        return cloud.Minted(f"kqa_{uuid.uuid4().hex[:8]}_bench", self.clock() + seconds)

    async def handoff(self, handoff: cloud.Handoff) -> cloud.Handed:
        lease = str(uuid.uuid4())
        self.on.setdefault(handoff.agent_id, {})[handoff.task_id] = cloud.FleetRun(
            handoff.task_id, lease, UNITS_PER_GPU
        )
        return cloud.Handed(lease, self.clock())

    async def report(self, instances: list[cloud.Instance]) -> cloud.FleetView:
        now = self.clock()
        for instance in instances:
            if instance.state in (cloud.BOOTING, cloud.BUSY, cloud.IDLE):
                self.launched.setdefault(instance.name, now)
            if instance.state in cloud.ENDED:
                self.ended.setdefault(instance.name, now)
        agents = tuple(
            cloud.FleetAgent(name, self.connected(name), tuple(self.on.get(name, {}).values()))
            for name in self.launched
            if name not in self.ended
        )
        return cloud.FleetView(now, agents)

    def connected(self, name: str) -> bool:
        return self.clock() >= self.launched.get(name, math.inf) + self.boot

    def run(self) -> list[str]:
        """Start what connected agents were handed; end what ran its time. Returns the tasks ended now."""
        now, finished = self.clock(), []
        for name, runs in self.on.items():
            if not self.connected(name) or name in self.ended:
                continue
            for task_id in list(runs):
                started = self.started.setdefault(task_id, now)
                if now - started >= self.minutes * 60:
                    del runs[task_id]
                    self.done[task_id] = now
                    self.placed -= 1
                    finished.append(task_id)
        return finished


async def klique(args: argparse.Namespace, endpoint: str, work: Path) -> dict[str, float]:
    import boto3

    client = boto3.client("ec2", region_name=REGION, endpoint_url=endpoint)
    image = client.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    settings = CloudSettings.read(
        {
            "agent": {
                "cloud": {
                    "region": REGION, "endpoint_url": endpoint, "image": image, "instance_type": "g5.xlarge",
                    "max_instances": args.max, "idle_timeout_seconds": args.idle,
                    "boot_timeout_seconds": max(args.boot * 2, 300), "tick_seconds": STEP,
                }
            }
        }
    )  # fmt: skip
    clock = Clock()
    plane = Plane(clock, capacity=args.max, boot=args.boot, minutes=args.minutes)
    state = State(work / "agent.sqlite")
    scaler = Autoscaler(
        settings, state, Ec2(REGION, endpoint), work, "bench", gpus_per_instance=1, clock=clock
    )
    scaler.plane = plane  # type: ignore[assignment]

    async def report(task_id: str, kind: str, body: dict[str, object], offset: object = None) -> None:
        return None

    scaler.adopt(report)
    first = clock()
    plane.queue = [f"task-{number:04}" for number in range(args.tasks)]
    all_running_at = last_done_at = None
    decisions = 0.0
    while len(plane.done) < args.tasks or any(name not in plane.ended for name in plane.launched):
        while plane.queue and plane.placed < plane.capacity:  # the scheduler, in submit order
            task_id = plane.queue.pop(0)
            state.lease_begin(task_id, str(uuid.uuid4()), 1)
            assignment = {"task_id": task_id, "lease_id": state.lease(task_id), "size_units": UNITS_PER_GPU}
            await scaler.start(assignment, report)
            plane.placed += 1
        started = time.perf_counter()
        await scaler.tick()
        decisions += time.perf_counter() - started
        plane.run()
        live = [name for name in plane.launched if name not in plane.ended and plane.connected(name)]
        if all_running_at is None and len(live) >= args.max:
            all_running_at = clock() - first
        if last_done_at is None and len(plane.done) == args.tasks:
            last_done_at = clock() - first
        clock.now += STEP
        if clock() - first > 7 * 86400:
            raise SystemExit("the burst did not end within a simulated week")
    instance_seconds = sum(plane.ended[name] - plane.launched[name] for name in plane.launched)
    return {
        "instances": len(plane.launched),
        "to_all_running": all_running_at if all_running_at is not None else math.inf,
        "to_last_done": last_done_at or math.inf,
        "instance_hours": instance_seconds / 3600,
        "decision_seconds": decisions,
    }


def oracle(args: argparse.Namespace) -> dict[str, float]:
    """Knows the burst: exactly max instances at the first submit, tasks back to back, each instance ended
    the moment its last task ends."""
    per_instance = math.ceil(args.tasks / args.max)
    rounds = [per_instance] * (args.tasks // per_instance) + (
        [args.tasks % per_instance] if args.tasks % per_instance else []
    )
    instance_seconds = sum(args.boot + count * args.minutes * 60 for count in rounds)
    return {
        "instances": len(rounds),
        "to_all_running": args.boot,
        "to_last_done": args.boot + per_instance * args.minutes * 60,
        "instance_hours": instance_seconds / 3600,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--max", type=int, default=50)
    parser.add_argument("--minutes", type=float, default=30.0, help="each task's run time")
    parser.add_argument("--boot", type=float, default=120.0, help="seconds from launch to the agent's hello")
    parser.add_argument("--idle", type=float, default=600.0, help="the autoscaler's idle timeout, seconds")
    args = parser.parse_args()
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": REGION}
    )
    moto, endpoint = start_moto(MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION="true")
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="klique-autoscale-") as work:
            ours = asyncio.run(klique(args, endpoint, Path(work)))
    finally:
        moto.terminate()
        moto.wait(timeout=10)
    best = oracle(args)
    gpu_hours = args.tasks * args.minutes / 60
    print(
        f"burst: {args.tasks} one-GPU tasks of {args.minutes:g} min on a pool of at most {args.max} one-GPU "
        f"instances; boot {args.boot:g} s, idle timeout {args.idle:g} s (simulated time; ran in "
        f"{time.perf_counter() - started:.1f} s)"
    )
    print(f"{'':34} {'Klique':>12} {'oracle':>12}")
    ours["per_gpu_hour"] = ours["instance_hours"] / gpu_hours
    best["per_gpu_hour"] = best["instance_hours"] / gpu_hours
    shown = [
        ("instances started", "instances", 1, "{:.0f}"),
        (f"first submit to {args.max} running (s)", "to_all_running", 1, "{:.0f}"),
        ("first submit to last done (min)", "to_last_done", 60, "{:.1f}"),
        ("instance-hours", "instance_hours", 1, "{:.2f}"),
        ("instance-hours / GPU-hours used", "per_gpu_hour", 1, "{:.3f}"),
    ]
    rows = [
        (label, form.format(ours[key] / unit), form.format(best[key] / unit))
        for label, key, unit, form in shown
    ]
    rows.insert(4, ("GPU-hours used", f"{gpu_hours:.2f}", f"{gpu_hours:.2f}"))
    for label, klique_figure, oracle_figure in rows:
        print(f"{label:34} {klique_figure:>12} {oracle_figure:>12}")
    ticks = ours["to_last_done"] / STEP
    print(
        f"autoscaler decisions: {ours['decision_seconds']:.1f} s (CPU and moto calls) over {ticks:.0f} passes"
    )
    ratio = ours["instance_hours"] / best["instance_hours"]
    print(f"ratio: {ratio:.3f} ({ours['instance_hours']:.2f} / {best['instance_hours']:.2f} instance-hours)")


if __name__ == "__main__":
    main()
