"""The configuration the test world provisions in tenant A (acme)."""

from __future__ import annotations

from typing import Any

DAY = 86_400  # heartbeat timeout long enough that the session's pools stay online without an agent


def acme_document() -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "baremetal",
                "environment": "baremetal",
                "capacity_gpus": 8,
                "gpu_class": "A100",
                "sharing": ["whole", "fraction"],
                "heartbeat_timeout_seconds": DAY,
            },
            {
                "name": "h100",
                "environment": "kubernetes",
                "capacity_gpus": 8,
                "gpu_class": "H100",
                "sharing": ["whole", "mig_static"],
                "heartbeat_timeout_seconds": DAY,
            },
        ],
        "profiles": [
            {
                "name": "four-gpu",
                "display_name": "4 GPUs",
                "gpus": "4",
                "pools": [{"pool": "baremetal"}, {"pool": "h100"}],
            },
            {
                "name": "shared",
                "display_name": "shared GPU",
                "sharing": "fraction",
                "min_gpus": "0.25",
                "max_gpus": "0.5",
                "pools": [{"pool": "baremetal"}],
            },
            {
                "name": "mig-small",
                "display_name": "MIG 1g.10gb",
                "sharing": "mig",
                "mig_profile": "1g.10gb",
                "pools": [{"pool": "h100"}],
            },
            {
                "name": "multi-node",
                "display_name": "multi-node training",
                "nodes": 2,
                "gpus_per_node": 4,
                "pools": [{"pool": "h100"}],
                "strict_fifo": True,
            },
        ],
        "policies": [
            {
                "name": "research",
                "group": "research",
                "reservation_gpus": "8",
                "limit_gpus": "16",
                "compute_resources": [
                    {"profile": "four-gpu", "name": "Research: 4 GPUs"},
                    {"profile": "shared", "name": "Research: shared GPU"},
                    {"profile": "mig-small", "name": "Research: MIG slice"},
                    {"profile": "multi-node", "name": "Research: multi-node training"},
                ],
            },
            {
                "name": "dev",
                "group": "dev",
                "reservation_gpus": "8",
                "limit_gpus": "16",
                "compute_resources": [{"profile": "four-gpu", "name": "Dev: 4 GPUs", "queuing_priority": 10}],
            },
        ],
    }
