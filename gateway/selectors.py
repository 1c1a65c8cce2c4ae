"""What the gateway's API and the portal read: the tenant's gateway configuration and its calls' usage."""

from __future__ import annotations

from django.db.models import QuerySet

from apps.accounts.models import Role, User
from gateway.models import GatewaySettings, Usage


def settings_get() -> GatewaySettings:
    return GatewaySettings.objects.filter(pk=1).first() or GatewaySettings(pk=1, document={})


def usage_for(user: User) -> QuerySet[Usage]:
    """Usage rows a user may read: everyone's for admins, their own for everyone else."""
    rows = Usage.objects.all()
    return rows if user.has_role(Role.ADMIN) else rows.filter(user_id=user.pk)
