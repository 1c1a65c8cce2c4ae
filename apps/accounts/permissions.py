"""Who may do what: tenant roles on every endpoint, project admins on their projects, provider admins
in the public schema only."""

from __future__ import annotations

from typing import Any

from django_tenants.utils import get_public_schema_name
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from apps.accounts.models import ApiToken, Project, ProjectMembership, Role, User


class TenantRole(BasePermission):
    """Reads need the view's `read_role` (viewer by default), writes its `write_role` (admin by default)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        if not isinstance(user, User):
            return False
        needed = (
            getattr(view, "read_role", Role.VIEWER)
            if request.method in SAFE_METHODS
            else getattr(view, "write_role", Role.ADMIN)
        )
        if user.has_role(needed):
            return self._scope_allows(request, view)
        self.message = (
            f"This needs the {needed} role in this tenant and {user.username} is a {user.role}. "
            "Ask a tenant admin for access."
        )
        return False

    def _scope_allows(self, request: Request, view: Any) -> bool:
        """A token acts with the lesser of its user's role and its own scope: read tokens only read;
        submit tokens also submit and cancel tasks (views that say `submit_scope = True`)."""
        token = request.auth
        if not isinstance(token, ApiToken) or token.scope == ApiToken.Scope.ADMIN:
            return True
        if request.method in SAFE_METHODS:
            return True
        if token.scope == ApiToken.Scope.SUBMIT and getattr(view, "submit_scope", False):
            return True
        who = f"agent {token.agent}'s token" if token.agent else f"token klq_{token.prefix}"
        self.message = f"This {who} has scope {token.scope}, which does not allow this. " + (
            "It may only read."
            if token.scope == ApiToken.Scope.READ
            else "It may read and submit or cancel tasks."
        )
        return False


def is_project_admin(user: User, project: Project) -> bool:
    if user.has_role(Role.ADMIN):
        return True
    return ProjectMembership.objects.filter(project=project, user=user, role=Role.ADMIN).exists()


class ProviderAdmin(BasePermission):
    """The provider's admins: users of the public schema, on the provider's own address."""

    message = "Only the platform provider's admins may do this, at the provider's address."

    def has_permission(self, request: Request, view: Any) -> bool:
        tenant = getattr(request, "tenant", None)
        user = request.user
        return (
            tenant is not None
            and tenant.schema_name == get_public_schema_name()
            and isinstance(user, User)
            and user.has_role(Role.ADMIN)
        )
