"""Telling a pool's connected agents something: each pool is a channel group its agents' sessions join."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import transaction

from apps.core.events import send_to_group

if TYPE_CHECKING:
    from tenants.models import Tenant


def pool_group(schema_name: str, pool_id: object) -> str:
    return f"agents.{schema_name}.{pool_id}"


def notify_pool(*, tenant: Tenant, pool_id: object, message: dict[str, Any]) -> None:
    """Send `message` to the pool's connected agents once the current transaction commits."""
    group = pool_group(tenant.schema_name, pool_id)
    notice = {"type": "plane.message", "message": message}
    transaction.on_commit(lambda: send_to_group(group, notice, what=f"a {message.get('type')} notice"))
