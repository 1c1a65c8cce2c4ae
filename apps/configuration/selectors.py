"""Reads for the configuration's API and the portal's pages."""

from __future__ import annotations

from apps.accounts.models import User
from apps.scheduling import selectors as scheduling


def compute_resource_figures(user: User) -> dict[str, object]:
    """What the compute resources' listing shows beside each: whether the user may submit to it, its queue
    depth and its recent waits."""
    return {
        "open": set(scheduling.compute_resources_for(user).values_list("pk", flat=True)),
        "depths": scheduling.queue_depths(),
        "waits": scheduling.queue_wait(by="compute_resource"),
    }
