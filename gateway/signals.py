"""Bump a tenant's gateway epoch whenever something the gateway caches changes, once the change commits.

The gateway caches who a token is (its user, role, project and budgets) and the tenant's configuration;
its reserve script refuses to run on a cached copy older than the epoch, so revoking a token, removing a
member or lowering a budget takes effect on the next call in every gateway process."""

from __future__ import annotations

from typing import Any

from django.db import connection, transaction
from django.db.models.signals import post_delete, post_save

from apps.accounts.models import ApiToken, ProjectMembership, User
from apps.vault.models import Secret
from gateway.models import Budget, GatewaySettings
from tenants.models import Tenant


def bump(schema: str) -> None:
    from gateway.budgets import epoch_key
    from gateway.cache import sync_redis

    sync_redis().incr(epoch_key(schema))


def _changed(sender: Any, **kwargs: Any) -> None:
    schema = getattr(connection, "schema_name", "")
    if schema and schema != "public":
        transaction.on_commit(lambda: bump(schema))


def _tenant_changed(sender: Any, instance: Tenant, **kwargs: Any) -> None:
    schema = instance.schema_name
    transaction.on_commit(lambda: bump(schema))


for model in (ApiToken, User, ProjectMembership, Budget, GatewaySettings, Secret):
    post_save.connect(_changed, sender=model, dispatch_uid=f"gateway-epoch-save-{model.__name__}")
    post_delete.connect(_changed, sender=model, dispatch_uid=f"gateway-epoch-delete-{model.__name__}")
post_save.connect(_tenant_changed, sender=Tenant, dispatch_uid="gateway-epoch-tenant")
