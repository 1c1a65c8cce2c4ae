"""factory_boy factories for accounts objects. Call them inside `schema_context(...)`: rows land in the
schema the connection is in, as in production code."""

from __future__ import annotations

from factory import declarations
from factory.django import DjangoModelFactory

from apps.accounts.models import Group, Project, ProjectMembership, Role, User


class UserFactory(DjangoModelFactory[User]):
    class Meta:
        model = User

    username = declarations.Sequence(lambda n: f"person{n}")
    email = declarations.LazyAttribute(lambda user: f"{user.username}@example.test")
    role = Role.MEMBER


class ProjectFactory(DjangoModelFactory[Project]):
    class Meta:
        model = Project

    name = declarations.Sequence(lambda n: f"project-{n}")


class ProjectMembershipFactory(DjangoModelFactory[ProjectMembership]):
    class Meta:
        model = ProjectMembership

    project = declarations.SubFactory(ProjectFactory)
    user = declarations.SubFactory(UserFactory)
    role = Role.MEMBER


class GroupFactory(DjangoModelFactory[Group]):
    class Meta:
        model = Group

    name = declarations.Sequence(lambda n: f"group-{n}")
