"""Who may do what: tenant roles on every endpoint, project admins on their projects, provider admins
in the public schema only."""

from __future__ import annotations

from typing import Any

from django_tenants.utils import get_public_schema_name
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from apps.accounts.models import Project, ProjectMembership, Role, User


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
            return True
        self.message = (
            f"This needs the {needed} role in this tenant and {user.username} is a {user.role}. "
            "Ask a tenant admin for access."
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
