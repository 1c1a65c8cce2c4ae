"""What a cloud provider must offer the autoscaler: launch a tagged instance with user data, list the
instances it tagged, end one, and say what stops it from launching. AWS EC2 (agents.cloud.ec2) implements
it; a provider for GCP, Azure or a neocloud's API implements the same five calls (docs/cloud.md says what
each must do).

Every call is synchronous (the autoscaler runs it in a thread) and raises ProviderError for anything the
provider refuses, with the kind of refusal (`credentials`, `quota`, `capacity`, `image`,
`instance_type`, `network`, `unavailable`, `other`) and a sentence an administrator can act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

# A provider's view of an instance's state, in the autoscaler's words:
PENDING, RUNNING, ENDING, GONE = "pending", "running", "ending", "gone"

# Kinds of refusal. A refusal of the first group is the pool's problem until it is fixed (no instance can
# start); the others are about one launch, which may be tried again later.
CREDENTIALS, IMAGE, INSTANCE_TYPE, NETWORK = "credentials", "image", "instance_type", "network"
QUOTA, CAPACITY, UNAVAILABLE, OTHER = "quota", "capacity", "unavailable", "other"
LASTING = frozenset({CREDENTIALS, IMAGE, INSTANCE_TYPE, NETWORK})


class ProviderError(Exception):
    """The provider refused; `kind` says which way, the message what to do."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Launch:
    """One instance to start."""

    name: str  # the instance's (and its agent's) name, unique in the tenant
    instance_type: str
    image: str
    user_data: str  # the bootstrap script, run once at first boot
    spot: bool = False
    subnet: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)  # the autoscaler finds its instances by these


@dataclass(frozen=True)
class Seen:
    """An instance as the provider lists it."""

    provider_id: str
    name: str  # from its tags
    state: str  # PENDING, RUNNING, ENDING or GONE
    instance_type: str = ""
    spot: bool = False
    interruption: str = ""  # the provider's notice that it will reclaim the instance, in words, or ""


class Provider(Protocol):
    region: str

    def launch(self, launch: Launch) -> str:
        """Start one instance; its provider id. Raises ProviderError."""

    def instances(self, tags: Mapping[str, str]) -> list[Seen]:
        """Every instance carrying all these tags that has not been gone for long. Raises ProviderError."""

    def terminate(self, provider_ids: list[str]) -> None:
        """End these instances (ending one already gone is not an error). Raises ProviderError."""

    def gpus_of(self, instance_type: str) -> int | None:
        """How many GPUs an instance of this type has, where the provider says; None where it does not."""

    def check(self, instance_type: str, image: str, subnet: str) -> None:
        """Raise ProviderError if a launch of this type, image and subnet would be refused for a lasting
        reason (credentials, an unknown image or type, a subnet that does not exist), without starting
        anything."""
