"""Reads of accounts, in the schema the caller is in."""

from __future__ import annotations

from django.db.models import QuerySet

from apps.accounts.models import ApiToken, Group, Project, ProjectMembership, User


def person_list() -> QuerySet[User]:
    return User.objects.filter(kind=User.Kind.PERSON)


def service_account_list() -> QuerySet[User]:
    return User.objects.filter(kind=User.Kind.SERVICE)


def group_list() -> QuerySet[Group]:
    return Group.objects.prefetch_related("members")


def project_list() -> QuerySet[Project]:
    return Project.objects.all()


def project_members(project: Project) -> QuerySet[ProjectMembership]:
    return ProjectMembership.objects.filter(project=project).select_related("user")


def tokens_visible_to(user: User) -> QuerySet[ApiToken]:
    """A user's own tokens; a tenant admin also sees (to revoke) every token in the tenant."""
    tokens = ApiToken.objects.select_related("user")
    return tokens if user.has_role("admin") else tokens.filter(user=user)
