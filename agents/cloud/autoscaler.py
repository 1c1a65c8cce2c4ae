"""The cloud backend: an autoscaler that is its pool's listener and starts instances for the work it gets.

It connects like any agent, so its pool is online with no instance at all, and accepts the pool's
assignments under their leases. Each task waits here until an instance has room for it: one already
started whose GPUs are not all taken, or a new one while fewer than max_instances exist. The task is then
handed to that instance's agent (protocol.cloud: the plane ends this run and starts the task's next one,
under a new lease, on that agent), which picks it up when it says hello. An instance is bootstrapped with
user data that starts `klique-agent --backend baremetal` under its own name, with a token minted for it.

Every decision (place a task, start an instance, end one) is made in one pass, `tick`, under one lock; so
an instance is never ended in the same moment it takes a task, and concurrent assignments never start more
than max_instances. What the autoscaler knows (the tasks waiting, its instances and which tasks each took)
is written to its work folder after each change, and every instance carries the autoscaler's tags, so a
restarted autoscaler adopts its instances and starts none twice.

The cloud's own word wins over the autoscaler's: an instance the provider ends, or announces it will
reclaim (a spot interruption), is reported interrupted, and the plane puts its tasks back at the front of
their queues as preempted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agents.backend import Refused, Report, Upload
from agents.cloud import providers
from agents.cloud.bootstrap import user_data
from agents.cloud.plane import Plane, PlaneError
from agents.cloud.providers import Launch, Provider, ProviderError, Seen
from agents.cloud.settings import CloudSettings
from agents.state import JobRecord, State
from protocol import cloud
from protocol.units import UNITS_PER_GPU

logger = logging.getLogger("klique.agent.cloud")

AUTOSCALER_TAG = "klique:autoscaler"
CONNECTED_PATIENCE_SECONDS = 120.0  # how long a connected instance's agent has to accept a handoff
BOOT_MARGIN_SECONDS = 60.0  # added to what is left of the boot timeout for a booting instance's agent
RETRY_SECONDS = {providers.QUOTA: 300.0, providers.CAPACITY: 60.0, providers.UNAVAILABLE: 30.0}
LASTING_RETRY_SECONDS = 60.0  # how often a lasting refusal (credentials, image) is checked again
WAITING_JOB = "cloud:waiting"  # the jobs-table entry that keeps a waiting task's lease
# A provider's listing may not show an instance yet for a while after its launch (EC2's is eventually
# consistent): one not listed this soon is not taken for gone.
LISTING_GRACE_SECONDS = 180.0


@dataclass
class Slot:
    """A task handed to an instance: the new run's lease, its size, and when the plane took it."""

    task_id: str
    lease_id: str
    units: int
    handed_at: float  # the plane's clock


@dataclass
class Machine:
    """One instance: what the autoscaler asked for and what it has seen of it."""

    name: str
    instance_type: str
    gpus: int
    spot: bool
    launched_at: float
    state: str = cloud.LAUNCHING
    provider_id: str = ""
    connected: bool = False
    slots: dict[str, Slot] = field(default_factory=dict)
    idle_since: float | None = None
    reason: str = ""

    @property
    def ended(self) -> bool:
        return self.state in cloud.ENDED

    @property
    def used(self) -> int:
        return sum(slot.units for slot in self.slots.values())

    def report(self, region: str) -> cloud.Instance:
        return cloud.Instance(
            name=self.name,
            state=self.state,
            instance_type=self.instance_type,
            provider_id=self.provider_id,
            gpus=self.gpus,
            spot=self.spot,
            region=region,
            reason=self.reason[: cloud.MAX_REASON],
        )


@dataclass
class Waiting:
    """A task this autoscaler accepted and has not yet handed to an instance."""

    task_id: str
    lease_id: str
    units: int
    since: float
    said: str = ""  # the reason last reported for it


class Autoscaler:
    """The Backend for `klique-agent --backend cloud`."""

    name = "cloud"

    def __init__(
        self,
        settings: CloudSettings,
        state: State,
        provider: Provider,
        work_dir: Path,
        agent_id: str,
        *,
        gpus_per_instance: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings, self.state, self.provider, self.agent_id = settings, state, provider, agent_id
        self.gpus_per_instance = gpus_per_instance
        self.clock = clock
        self.upload: Upload | None = None
        self.problem = ""  # what stops instances from starting; the plane places no work here meanwhile
        self.problem_kind = ""
        self.retry_at = 0.0
        self.plane: Plane | None = None  # set once the agent's token is known
        self.url = ""
        self.reporting: Report | None = None
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.path = work_dir / "cloud.json"
        self.waiting: dict[str, Waiting] = {}
        self.machines: dict[str, Machine] = {}
        self._load()

    # -- what the agent loop asks of a backend ---------------------------------------------------------

    @property
    def tags(self) -> dict[str, str]:
        return {AUTOSCALER_TAG: self.agent_id}

    def inventory(self) -> dict[str, Any]:
        return {
            "provider": self.settings.provider,
            "region": self.provider.region,
            "instance_type": self.settings.instance_type,
            "gpus_per_instance": self.gpus_per_instance,
            "max_instances": self.settings.max_instances,
            "spot": self.settings.spot,
            "gpus": 0,  # none of its own: its instances' agents offer theirs
        }

    async def capacity(self) -> dict[str, Any]:
        return {"nodes": sum(1 for machine in self.machines.values() if not machine.ended)}

    def running(self) -> list[str]:
        return sorted(self.waiting)

    def queue(self) -> list[dict[str, Any]]:
        return [
            {
                "task_id": waiting.task_id,
                "state": "pending",
                "reason": waiting.said or "waiting for an instance",
            }
            for waiting in self.waiting.values()
        ]

    def adopt(self, report: Report) -> list[str]:
        self.reporting = report
        for task_id in list(self.waiting):  # a task whose lease is gone here was answered for already
            if not self.state.lease(task_id):
                del self.waiting[task_id]
        self._save()
        return sorted(self.waiting)

    async def start(self, assignment: dict[str, Any], report: Report) -> None:
        self.reporting = report
        task_id = str(assignment["task_id"])
        units = int(assignment.get("size_units") or 0)
        if int(assignment.get("nodes") or 1) > 1:
            raise Refused(
                "A cloud pool's instances each run their own tasks: a multi-node task needs a pool whose "
                "environment starts its nodes together (Slurm, Kubernetes).",
                permanent=True,
            )
        if assignment.get("sharing") == "mig":
            raise Refused("This pool's instances are not set up for MIG slices.", permanent=True)
        if units > self.gpus_per_instance * UNITS_PER_GPU:
            raise Refused(
                f"The task needs {units / UNITS_PER_GPU:g} GPUs and a {self.settings.instance_type} instance "
                f"has {self.gpus_per_instance}.",
                permanent=True,
            )
        if self.problem:
            raise Refused(f"No instance can be started now: {self.problem}")
        if task_id not in self.waiting:
            self.waiting[task_id] = Waiting(task_id, str(assignment["lease_id"]), units, self.clock())
            self.state.add_job(JobRecord(task_id, WAITING_JOB, "", ""))
            self._save()
        self.wake.set()

    async def stop(self, task_id: str, grace_seconds: float) -> None:
        """An abort or preemption of a task still waiting here: it simply waits no more."""
        async with self.lock:
            self._forget(task_id)
            self._save()

    async def stop_all(self, grace_seconds: float) -> None:
        """The autoscaler stops; its instances and the tasks waiting here stay, for when it comes back."""
        self._save()

    # -- the loop ----------------------------------------------------------------------------------------

    async def follow(self, stopping: asyncio.Event) -> None:
        """Look at the instances and the plane's view every tick_seconds, and at once when work arrives."""
        while not stopping.is_set():
            try:
                await self.tick()
            except Exception:  # a surprise must not stop the autoscaler; the next tick tries again
                logger.exception("the autoscaler's pass failed")
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=self.settings.tick_seconds)

    async def tick(self) -> None:
        async with self.lock:
            now = self.clock()
            await self._recheck(now)
            try:
                seen = await asyncio.to_thread(self.provider.instances, self.tags)
            except ProviderError as error:
                logger.warning("cannot list the instances: %s", error)
                self.refused(error, now)
                seen = None
            if seen is not None:
                self._observe(seen, now)
            fleet = await self._report()
            if fleet is not None:
                self._follow(fleet, now)
            await self._place(now)
            await self._scale_in(now)
            self._save()

    # -- observing ---------------------------------------------------------------------------------------

    def _observe(self, seen: list[Seen], now: float) -> None:
        """Bring each instance's state in line with the provider's listing; adopt tagged instances this
        autoscaler does not know (its notes lost); an instance the cloud ended or will reclaim is
        interrupted."""
        listed = {instance.name: instance for instance in seen if instance.name}
        for name, found in listed.items():
            if name not in self.machines and found.state in (providers.PENDING, providers.RUNNING):
                self.machines[name] = Machine(
                    name, found.instance_type, self.gpus_per_instance, found.spot, now,
                    state=cloud.BOOTING, provider_id=found.provider_id, idle_since=now,
                )  # fmt: skip
                logger.info("adopted instance %s (%s)", name, found.provider_id)
        for machine in self.machines.values():
            if machine.ended:
                continue
            instance = listed.get(machine.name)
            if instance is None:
                if now - machine.launched_at >= LISTING_GRACE_SECONDS:  # (sooner, it may not show yet)
                    self._missing(machine)
                continue
            machine.provider_id = instance.provider_id or machine.provider_id
            if instance.state in (providers.ENDING, providers.GONE) or instance.interruption:
                if machine.state == cloud.STOPPING:
                    if instance.state == providers.GONE:
                        self._end(machine, cloud.STOPPED, machine.reason)
                    continue
                why = instance.interruption or f"the provider ended it ({instance.state})"
                self._end(machine, cloud.INTERRUPTED, why)
            elif machine.state == cloud.LAUNCHING:
                machine.state = cloud.BOOTING

    def _missing(self, machine: Machine) -> None:
        """An instance the provider no longer lists: never started, ended as asked, or gone by itself."""
        if machine.state == cloud.LAUNCHING:  # asked, and the provider never made it
            self._end(machine, cloud.FAILED, "the provider never started it")
        elif machine.state == cloud.STOPPING:
            self._end(machine, cloud.STOPPED, machine.reason)
        else:
            self._end(machine, cloud.INTERRUPTED, "the provider no longer lists it")

    def _end(self, machine: Machine, state: str, reason: str) -> None:
        if machine.state not in (cloud.STOPPING, cloud.LAUNCHING) or state != cloud.STOPPED:
            logger.info("instance %s %s: %s", machine.name, state, reason)
        machine.state, machine.reason, machine.connected = state, reason, False

    async def _report(self) -> cloud.FleetView | None:
        """Tell the plane every instance's state; forget the ended ones it has heard of."""
        if self.plane is None:
            return None
        instances = [machine.report(self.provider.region) for machine in self.machines.values()]
        try:
            fleet = await self.plane.report(instances)
        except PlaneError as error:
            logger.warning("cannot report the instances: %s", error)
            return None
        for instance in instances:
            if instance.state in cloud.ENDED:
                self.machines.pop(instance.name, None)
        return fleet

    def _follow(self, fleet: cloud.FleetView, now: float) -> None:
        """Which instance agents are connected and which runs each holds, as the plane sees them. A task
        handed to an instance leaves it only by a view taken after the handoff: one older than the handoff
        cannot show it yet, and must not make the instance look idle."""
        agents = {agent.agent_id: agent for agent in fleet.agents}
        for machine in self.machines.values():
            if machine.ended or machine.state == cloud.LAUNCHING:
                continue
            agent = agents.get(machine.name)
            machine.connected = agent is not None and agent.connected
            runs = {run.task_id: run for run in agent.runs} if agent is not None else {}
            for task_id, slot in list(machine.slots.items()):
                if task_id not in runs and fleet.as_of > slot.handed_at:
                    del machine.slots[task_id]
            for task_id, run in runs.items():
                if task_id not in machine.slots:  # handed before a restart of this autoscaler
                    machine.slots[task_id] = Slot(task_id, run.lease_id, run.units, fleet.as_of)
            if machine.state == cloud.STOPPING:
                continue
            if machine.connected:
                machine.state = cloud.BUSY if machine.slots else cloud.IDLE
            if machine.slots:
                machine.idle_since = None
            elif machine.idle_since is None:
                machine.idle_since = now

    # -- deciding ----------------------------------------------------------------------------------------

    def _open(self) -> list[Machine]:
        """Instances that may take a task: started or starting, not being ended."""
        return [
            machine
            for machine in self.machines.values()
            if machine.state in (cloud.BOOTING, cloud.IDLE, cloud.BUSY)
        ]

    def _counted(self) -> int:
        return sum(1 for machine in self.machines.values() if not machine.ended)

    async def _place(self, now: float) -> None:
        for waiting in sorted(self.waiting.values(), key=lambda item: (item.since, item.task_id)):
            if self.problem:
                await self._give_back(waiting, f"no instance can be started: {self.problem}")
                continue
            room = [
                machine
                for machine in self._open()
                if machine.gpus * UNITS_PER_GPU - machine.used >= waiting.units
            ]
            # The fullest instance that fits keeps whole instances free for large tasks, and lets the
            # emptiest ones go idle and end.
            machine = max(room, key=lambda item: (item.used, -item.launched_at), default=None)
            if machine is None and self._counted() < self.settings.max_instances:
                machine = await self._launch(now)
                if machine is None:
                    if self.problem:  # the provider refused: this task goes back now, the rest follow
                        await self._give_back(waiting, f"no instance could be started: {self.problem}")
                    continue
            if machine is None:
                await self._say(
                    waiting,
                    f"all {self.settings.max_instances} instances (the pool's maximum) are busy; it starts "
                    "when one has room",
                )
                continue
            await self._hand(waiting, machine, now)

    async def _launch(self, now: float) -> Machine | None:
        """Start one instance: noted first (so a restart finds it by name), then its token, then the
        provider's launch. None when it could not be started (the waiting tasks were told why)."""
        assert self.plane is not None
        name = f"{self.agent_id[:40].lower().strip('-') or 'cloud'}-{secrets.token_hex(4)}"
        name = "".join(char if char.isalnum() or char == "-" else "-" for char in name).strip("-")
        machine = Machine(name, self.settings.instance_type, self.gpus_per_instance, self.settings.spot, now)
        self.machines[name] = machine
        self._save()
        try:
            minted = await self.plane.mint(name, self.settings.boot_timeout_seconds + BOOT_MARGIN_SECONDS)
            script = user_data(
                bootstrap=self.settings.bootstrap, url=self.plane.url, token=minted.token, name=name
            )
            launch = Launch(
                name=name,
                instance_type=self.settings.instance_type,
                image=self.settings.image,
                user_data=script,
                spot=self.settings.spot,
                subnet=self.settings.subnet,
                tags={**self.settings.tags, **self.tags},
            )
            machine.provider_id = await asyncio.to_thread(self.provider.launch, launch)
        except ProviderError as error:
            self._end(machine, cloud.FAILED, str(error))
            self.refused(error, now)
            return None
        except PlaneError as error:
            self._end(machine, cloud.FAILED, f"no token could be minted for it: {error}")
            return None
        machine.state = cloud.BOOTING
        logger.info("started instance %s (%s, %s)", name, machine.provider_id, machine.instance_type)
        return machine

    async def _hand(self, waiting: Waiting, machine: Machine, now: float) -> None:
        assert self.plane is not None
        if machine.connected:
            patience = CONNECTED_PATIENCE_SECONDS
        else:
            left = self.settings.boot_timeout_seconds - (now - machine.launched_at)
            patience = max(left, 0.0) + BOOT_MARGIN_SECONDS
        handoff = cloud.Handoff(waiting.task_id, waiting.lease_id, machine.name, min(patience, 3600.0))
        try:
            handed = await self.plane.handoff(handoff)
        except PlaneError as error:
            if error.refused:  # the run is not this autoscaler's any more (aborted, expired): let it go
                logger.info("task %s not handed to %s: %s", waiting.task_id, machine.name, error)
                self._forget(waiting.task_id)
            else:
                logger.warning("task %s not handed yet: %s", waiting.task_id, error)
            return
        machine.slots[waiting.task_id] = Slot(waiting.task_id, handed.lease_id, waiting.units, handed.at)
        machine.idle_since = None
        if machine.state == cloud.IDLE:
            machine.state = cloud.BUSY
        self._forget(waiting.task_id)
        logger.info("task %s handed to instance %s", waiting.task_id, machine.name)

    async def _scale_in(self, now: float) -> None:
        """End instances idle past the timeout, and those whose agent never said hello in time."""
        ending: list[Machine] = []
        for machine in self._open():
            if machine.slots:
                continue
            if not machine.connected and now - machine.launched_at > self.settings.boot_timeout_seconds:
                boot = self.settings.boot_timeout_seconds
                machine.reason = f"its agent did not say hello within {boot:.0f} s of its start"
            elif (
                machine.idle_since is not None
                and now - machine.idle_since >= self.settings.idle_timeout_seconds
            ):
                machine.reason = f"idle for {self.settings.idle_timeout_seconds:.0f} s"
            else:
                continue
            machine.state = cloud.STOPPING  # from here on no task is handed to it
            ending.append(machine)
        if ending:
            ids = [machine.provider_id for machine in ending if machine.provider_id]
            try:
                await asyncio.to_thread(self.provider.terminate, ids)
            except ProviderError as error:  # still STOPPING: asked again next pass
                logger.warning("cannot end instances %s: %s", ", ".join(ids), error)
                return
            for machine in ending:
                logger.info("ending instance %s: %s", machine.name, machine.reason)
        for machine in self.machines.values():  # asked before, still listed: ask again
            if machine.state == cloud.STOPPING and machine not in ending and machine.provider_id:
                with contextlib.suppress(ProviderError):
                    await asyncio.to_thread(self.provider.terminate, [machine.provider_id])

    # -- refusals ----------------------------------------------------------------------------------------

    def refused(self, error: ProviderError, now: float) -> None:
        """A refusal of the provider stops launches: lasting ones until a check passes, the others for a
        while. Meanwhile the pool takes no new work (its problem says why) and waiting tasks go back."""
        if error.kind in providers.LASTING or error.kind in RETRY_SECONDS:
            self.problem, self.problem_kind = str(error), error.kind
            self.retry_at = now + RETRY_SECONDS.get(error.kind, LASTING_RETRY_SECONDS)

    async def _recheck(self, now: float) -> None:
        if not self.problem or now < self.retry_at:
            return
        if self.problem_kind in providers.LASTING:
            try:
                await asyncio.to_thread(
                    self.provider.check,
                    self.settings.instance_type,
                    self.settings.image,
                    self.settings.subnet,
                )
            except ProviderError as error:
                self.problem, self.retry_at = str(error), now + LASTING_RETRY_SECONDS
                return
        logger.info("launches are allowed again (was: %s)", self.problem)
        self.problem = self.problem_kind = ""

    async def _give_back(self, waiting: Waiting, why: str) -> None:
        """The task goes back to the plane's queue (where it may go to the next pool), saying why."""
        if self.reporting is not None:
            await self.reporting(waiting.task_id, "result", {"requeue": True, "reason": why[:500]}, None)
        self._forget(waiting.task_id)

    async def _say(self, waiting: Waiting, reason: str) -> None:
        if waiting.said != reason and self.reporting is not None:
            waiting.said = reason
            body = {"state": "pending", "reason": reason[:500]}
            await self.reporting(waiting.task_id, "status", body, None)

    def _forget(self, task_id: str) -> None:
        if self.waiting.pop(task_id, None) is not None:
            self.state.remove_job(task_id)
            self.state.lease_end(task_id)

    # -- notes on disk -----------------------------------------------------------------------------------

    def _save(self) -> None:
        notes = {
            "waiting": [asdict(waiting) for waiting in self.waiting.values()],
            "machines": [asdict(machine) for machine in self.machines.values()],
        }
        draft = self.path.with_suffix(f".{os.getpid()}.tmp")
        draft.write_text(json.dumps(notes))
        os.replace(draft, self.path)

    def _load(self) -> None:
        try:
            notes = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as error:
            logger.warning("the notes %s cannot be read (%s); instances are found by tag", self.path, error)
            return
        for item in notes.get("waiting", []):
            self.waiting[item["task_id"]] = Waiting(**item)
        for item in notes.get("machines", []):
            slots = {task_id: Slot(**slot) for task_id, slot in item.pop("slots", {}).items()}
            self.machines[item["name"]] = Machine(**item, slots=slots)
