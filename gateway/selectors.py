"""What the gateway's API and the portal read: the tenant's gateway configuration and its calls' usage."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from apps.accounts.models import ProjectMembership, Role, User
from gateway.models import Budget, GatewaySettings, Usage


def settings_get() -> GatewaySettings:
    return GatewaySettings.objects.filter(pk=1).first() or GatewaySettings(pk=1, document={})


def usage_for(user: User) -> QuerySet[Usage]:
    """Usage rows a user may read: everyone's for admins, their own for everyone else."""
    rows = Usage.objects.all()
    return rows if user.has_role(Role.ADMIN) else rows.filter(user_id=user.pk)


def budgets_visible_to(user: User) -> QuerySet[Budget]:
    """Admins see every budget; others the tenant's, their own and their projects'."""
    rows = Budget.objects.select_related("project", "user")
    if user.has_role(Role.ADMIN):
        return rows
    projects = ProjectMembership.objects.filter(user=user).values("project_id")
    return rows.filter(Q(scope=Budget.Scope.TENANT) | Q(user=user) | Q(project__in=projects))


def budgets_applying_to(user: User) -> QuerySet[Budget]:
    """The budgets and wallets a user's gateway calls and GPU work draw from: the tenant's, their own and
    those of the projects they belong to (for an admin too: what applies to them, not everyone's)."""
    projects = ProjectMembership.objects.filter(user=user).values("project_id")
    return Budget.objects.select_related("project", "user").filter(
        Q(scope=Budget.Scope.TENANT) | Q(user=user) | Q(project__in=projects)
    )
