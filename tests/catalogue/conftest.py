"""Apps of tenant A's people for the catalogue's tests, on tenant A's test configuration."""

from __future__ import annotations

from typing import Any

from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.catalogue import services
from apps.catalogue.models import AppInstance, CatalogueEntry
from tests.fleet.conftest import _close_consumer_connections, fleet  # noqa: F401 -- fixtures here too
from tests.world import World

ENTRY: dict[str, Any] = {
    "name": "notebook",
    "version": "1",
    "command": ["notebook", "--port={port}"],
    "health": {"path": "/api"},
    "gpus": "4",
    "compute_resource": "Research: 4 GPUs",
    "variables": [{"name": "NOTEBOOK_DIR", "default": "/work"}],
    "idle_timeout_seconds": 600,
}


def launch(world: World, persona: str = "bob", **options: Any) -> AppInstance:
    """An app of `persona`'s, launched from the entry above (added once)."""
    tenant = world.tenant_a
    with schema_context(tenant.schema_name):
        if not CatalogueEntry.objects.filter(name="notebook").exists():
            services.entry_add(user=User.objects.get(username="alice"), document=ENTRY)
        user = User.objects.get(username=persona)
        return services.app_launch(tenant=tenant, user=user, entry="notebook", **options)
