"""People, service accounts, groups, projects and API tokens.

These tables exist in every schema: in the public schema they hold the provider's admins, in a tenant's
schema that tenant's people. A row's schema is its tenant, which is what makes another tenant's object a
404: it is not there to be found.
"""

from __future__ import annotations

import uuid

from django.contrib.auth.models import AbstractUser
from django.db import models
from django.utils import timezone


class Role(models.TextChoices):
    """A user's role across the whole tenant. In the public schema every active user is a provider admin."""

    VIEWER = "viewer"
    MEMBER = "member"
    ADMIN = "admin"


ROLE_RANK = {Role.VIEWER: 1, Role.MEMBER: 2, Role.ADMIN: 3}


class User(AbstractUser):
    class Kind(models.TextChoices):
        PERSON = "person"
        SERVICE = "service"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.PERSON)
    description = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["username"]

    def has_role(self, role: str) -> bool:
        return self.is_active and ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(role)]


class Group(models.Model):
    """A set of users; resource policies attach to groups."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    description = models.CharField(max_length=500, blank=True)
    members = models.ManyToManyField(User, related_name="klique_groups", blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Project(models.Model):
    """What work and spending are counted against; its admins manage its members."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100, unique=True)
    description = models.CharField(max_length=500, blank=True)
    cost_center = models.CharField(max_length=100, blank=True)  # chargeback exports group by it
    # Data residency: the regions its work must run in (every pool of a compute resource it uses is in one
    # of them); empty: anywhere.
    regions = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    members = models.ManyToManyField(User, through="ProjectMembership", related_name="projects")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ProjectMembership(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="project_memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["project__name", "user__username"]
        constraints = [models.UniqueConstraint(fields=["project", "user"], name="one_membership_per_project")]

    def __str__(self) -> str:
        return f"{self.user} in {self.project} as {self.role}"


class ApiToken(models.Model):
    """A bearer token. Only its SHA-256 is stored; the token itself is shown once, when it is created.

    A token is `klq_<prefix>_<secret>`: the prefix is public (it names the token in lists and logs), the
    secret carries 192 random bits, which is why a fast hash is enough here where a password would need a
    slow one.
    """

    class Scope(models.TextChoices):
        READ = "read"  # reads only
        SUBMIT = "submit"  # reads, and submits and cancels tasks
        ADMIN = "admin"  # all its user's role allows

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    scope = models.CharField(max_length=10, choices=Scope.choices, default=Scope.ADMIN)
    # A delegated token: an AI agent acting for `user`, with a narrower scope and its own GPU quota (the
    # GPUs its unfinished tasks may hold at once, in 1/840 units; None: only the user's own limits).
    agent = models.CharField(max_length=100, blank=True)
    gpu_quota_units = models.PositiveIntegerField(null=True, blank=True)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"klq_{self.prefix}"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and self.expires_at > timezone.now()

    @property
    def acting(self) -> str:
        """Who acts with this token, as the audit log and task history say it."""
        return f"agent {self.agent} for {self.user.username}" if self.agent else self.user.username


class SignInFailure(models.Model):
    """A refused password sign-in, kept for the limits on further attempts (per account and per address;
    apps.accounts.services.sign_in_limits). Rows older than the window mean nothing and are purged."""

    at = models.DateTimeField(db_index=True)
    username = models.CharField(max_length=150, db_index=True)
    address = models.CharField(max_length=64, db_index=True)

    def __str__(self) -> str:
        return f"{self.username} from {self.address} at {self.at:%Y-%m-%d %H:%M:%S}"
