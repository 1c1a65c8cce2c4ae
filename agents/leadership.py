"""At most one agent process acts for a pool's agent: the holder of a `coordination.k8s.io/v1` Lease.

The rules are client-go's leader election. A candidate takes the Lease when it does not exist, when its
holder let it go (an empty holder), or when this candidate has seen it unchanged for its whole duration
(time measured on the candidate's own clock, from when it saw the last change, so the clocks of two
nodes never need agree). Every write names the resource version it read: of two candidates writing at
once, the API server keeps one and answers the other 409 Conflict. The holder renews every
`retry_seconds`; one that has not renewed for `renew_deadline_seconds` (shorter than the Lease's
duration) stops acting at once, so that by the time a standby may take the Lease, the old holder has
stopped: a pod cut off from the API server by a partition cannot go on beside its replacement.

The Kubernetes calls are the caller's (`LeaseApi`), synchronous; this module imports no client.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger("klique.agent.leadership")


class Conflict(Exception):
    """Another candidate wrote the Lease first (409), or made it first."""


class LeaseApi(Protocol):
    def lease_get(self, name: str) -> dict[str, Any] | None: ...  # None where there is none
    def lease_create(self, body: Mapping[str, Any]) -> dict[str, Any]: ...  # raises Conflict
    def lease_patch(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]: ...  # raises Conflict


def micro_time(at: datetime.datetime | None = None) -> str:
    """A Lease's MicroTime: RFC 3339 with microseconds."""
    moment = at or datetime.datetime.now(tz=datetime.UTC)
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Leadership:
    api: LeaseApi
    name: str
    namespace: str
    identity: str  # this process: the pod's name and the process id
    lease_seconds: int = 15
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0
    clock: Callable[[], float] = time.monotonic
    observed: dict[str, Any] = field(default_factory=dict)  # the Lease's spec as last seen
    observed_version: str = ""
    observed_at: float = 0.0
    renewed_at: float = 0.0  # when this process last held it, on its clock
    told: str = ""  # the holder last named in the log, so a standby says so once per holder

    def __post_init__(self) -> None:
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError(
                "leader election needs retry_seconds < renew_deadline_seconds < lease_seconds "
                f"(given {self.retry_seconds}, {self.renew_deadline_seconds}, {self.lease_seconds})."
            )

    @property
    def holder(self) -> str:
        return str(self.observed.get("holderIdentity") or "")

    def attempt(self) -> bool:
        """One round: take or renew the Lease; True while this process holds it. Raises what the API
        raises other than a conflict (the caller counts it as not renewed)."""
        now = micro_time()
        current = self.api.lease_get(self.name)
        mine = {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds, "renewTime": now}
        if current is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {**mine, "acquireTime": now, "leaseTransitions": 0},
            }
            try:
                return self._took(self.api.lease_create(body))
            except Conflict:
                return False
        spec = dict(current.get("spec") or {})
        version = str((current.get("metadata") or {}).get("resourceVersion") or "")
        if version != self.observed_version or spec != self.observed:
            self.observed, self.observed_version, self.observed_at = spec, version, self.clock()
        holder = str(spec.get("holderIdentity") or "")
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        ours = holder == self.identity
        if holder and not ours and self.clock() < self.observed_at + duration:
            return False  # held, and renewed within its duration as far as this process has seen
        transitions = int(spec.get("leaseTransitions") or 0)
        patch = {
            "metadata": {"resourceVersion": version},  # the API server's precondition: 409 if it moved
            "spec": {
                **mine,
                "acquireTime": spec.get("acquireTime") if ours else now,
                "leaseTransitions": transitions if ours else transitions + 1,
            },
        }
        try:
            return self._took(self.api.lease_patch(self.name, patch))
        except Conflict:
            return False

    def _took(self, lease: Mapping[str, Any]) -> bool:
        self.observed = dict(lease.get("spec") or {})
        self.observed_version = str((lease.get("metadata") or {}).get("resourceVersion") or "")
        self.observed_at = self.renewed_at = self.clock()
        return True

    def _attempt_safely(self) -> bool:
        try:
            return self.attempt()
        except Exception as error:  # the API away, RBAC: not renewed this round
            logger.warning("the lease %s could not be read or written: %s", self.name, error)
            return False

    async def lead(self) -> None:
        """Wait until this process holds the Lease, saying once per holder that it stands by."""
        while not await asyncio.to_thread(self._attempt_safely):
            if self.holder and self.holder != self.told:
                self.told = self.holder
                logger.info(
                    "standing by: %s holds the lease %s; this agent takes over if it is not renewed for %d s",
                    self.holder,
                    self.name,
                    self.lease_seconds,
                )
            await asyncio.sleep(self.retry_seconds)
        logger.info("this agent (%s) holds the lease %s and acts for the pool", self.identity, self.name)

    async def keep(self, lost: Callable[[], None]) -> None:
        """Renew while holding; call `lost` (which must stop this process acting) once the renew deadline
        passes without a renewal, or another holder is seen."""
        while True:
            await asyncio.sleep(self.retry_seconds)
            if await asyncio.to_thread(self._attempt_safely):
                continue
            taken = self.holder not in ("", self.identity)
            if taken or self.clock() - self.renewed_at > self.renew_deadline_seconds:
                logger.error(
                    "this agent no longer holds the lease %s (%s); it stops acting so that only one does",
                    self.name,
                    f"{self.holder} took it"
                    if taken
                    else f"not renewed for {self.renew_deadline_seconds:g} s",
                )
                lost()
                return

    def release(self) -> None:
        """Let the Lease go at a clean stop: a standby takes over at once, not after its duration."""
        if self.holder != self.identity:
            return
        patch = {
            "metadata": {"resourceVersion": self.observed_version},
            "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": micro_time()},
        }
        try:
            self.api.lease_patch(self.name, patch)
        except Exception as error:  # it expires on its own
            logger.warning("the lease %s was not let go: %s", self.name, error)
