"""Who may do what: tenant roles on every endpoint, project admins on their projects, provider admins
in the public schema only."""

from __future__ import annotations

from typing import Any

from django_tenants.utils import get_public_schema_name
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from apps.accounts import access
from apps.accounts.models import ApiToken, Project, ProjectMembership, Role, User


class TenantRole(BasePermission):
    """Reads need the view's `read_role` (viewer by default), writes its `write_role` (admin by default); a
    token acts with the lesser of its user's role and its own scope (apps.accounts.access)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        if not isinstance(user, User):
            return False
        write = request.method not in SAFE_METHODS
        refused = access.refusal(
            user,
            request.auth if isinstance(request.auth, ApiToken) else None,
            needed=getattr(view, "write_role", Role.ADMIN)
            if write
            else getattr(view, "read_role", Role.VIEWER),
            write=write,
            submit=getattr(view, "submit_scope", False),
        )
        if refused:
            self.message = refused
        return not refused


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
