"""What the vault shows: secrets' names and who may see them, never their values."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from apps.accounts.models import Role, User
from apps.vault.models import Secret


def secrets_visible_to(user: User) -> QuerySet[Secret]:
    """Names a user may see (never values): the tenant's, their projects', their own; admins see all
    but other users' own."""
    secrets = Secret.objects.select_related("project", "owner", "created_by").prefetch_related(
        "audience_groups", "audience_projects"
    )
    mine = Q(scope=Secret.Scope.USER, owner=user)
    if user.has_role(Role.ADMIN):
        return secrets.filter(~Q(scope=Secret.Scope.USER) | mine)
    return secrets.filter(
        Q(scope=Secret.Scope.TENANT) | Q(scope=Secret.Scope.PROJECT, project__members=user) | mine
    ).distinct()
