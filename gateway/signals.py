"""Bump a tenant's gateway epoch whenever something the gateway caches changes, once the change commits.

The gateway caches who a token is (its user, role, project and budgets) and the tenant's configuration;
its reserve script refuses to run on a cached copy older than the epoch, so revoking a token, removing a
member or lowering a budget takes effect on the next call in every gateway process.

A model an app serves joins or leaves the gateway (SelfHosted) the same way, and a run's session key
opens and dies (Session). `selfhosted_wanted` asks for
the app of a sleeping self-hosted model to be started (apps.catalogue answers it).

Metered GPU time that costs something (apps.metering.signals.cost_recorded) is added to the live counters
of the wallets it draws from."""

from __future__ import annotations

from typing import Any

from django.db import connection, transaction
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.dispatch import Signal

from apps.accounts.models import ApiToken, Group, ProjectMembership, User
from apps.metering.signals import cost_recorded
from apps.vault.models import Secret
from gateway.budgets import epoch_key
from gateway.cache import sync_redis
from gateway.models import Budget, GatewaySettings, SelfHosted, Session
from gateway.wallets import charge
from tenants.models import Tenant


def bump(schema: str) -> None:
    sync_redis().incr(epoch_key(schema))


def _changed(sender: Any, **kwargs: Any) -> None:
    schema = getattr(connection, "schema_name", "")
    if schema and schema != "public":
        transaction.on_commit(lambda: bump(schema))


def _tenant_changed(sender: Any, instance: Tenant, **kwargs: Any) -> None:
    schema = instance.schema_name
    transaction.on_commit(lambda: bump(schema))


# A call wants a sleeping self-hosted model: start its app (tenant, app_id).
selfhosted_wanted = Signal()

for model in (ApiToken, User, ProjectMembership, Budget, GatewaySettings, Secret, SelfHosted, Session):
    post_save.connect(_changed, sender=model, dispatch_uid=f"gateway-epoch-save-{model.__name__}")
    post_delete.connect(_changed, sender=model, dispatch_uid=f"gateway-epoch-delete-{model.__name__}")
post_save.connect(_tenant_changed, sender=Tenant, dispatch_uid="gateway-epoch-tenant")
# Who may call a self-hosted model follows its app's groups.
m2m_changed.connect(_changed, sender=Group.members.through, dispatch_uid="gateway-epoch-group-members")


def _cost_recorded(
    sender: Any, *, user_id: str, project_id: str | None, cost_nano_usd: int, at: Any, **kwargs: Any
) -> None:
    charge(user_id=user_id, project_id=project_id, cost_nano_usd=cost_nano_usd, at=at)


cost_recorded.connect(_cost_recorded, dispatch_uid="gateway-wallet-charge")
