"""The configuration the test world provisions in tenant A (acme)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tenants.models import Tenant

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


def acme_tenant(*, slug: str, name: str, admin: str) -> Tenant:
    """A tenant of its own with acme's configuration provisioned, its admin in both groups, its pools
    online."""
    from django.utils import timezone
    from django_tenants.utils import schema_context

    from apps.accounts.models import User
    from apps.accounts.services import group_save
    from apps.configuration.services import draft_provision, draft_save
    from apps.provider.services import tenant_create
    from apps.resources.models import Pool

    created = tenant_create(slug=slug, name=name, admin_username=admin)
    with schema_context(slug):
        user = User.objects.get(username=admin)
        group_save(tenant=created.tenant, name="research", members=[user])
        group_save(tenant=created.tenant, name="dev", members=[user])
        draft_save(tenant=created.tenant, user=user, document=acme_document())
        draft_provision(tenant=created.tenant, user=user)
        Pool.objects.update(last_heartbeat_at=timezone.now())
    return created.tenant
