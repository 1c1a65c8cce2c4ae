"""Secrets at tenant, project and user level, encrypted with the tenant's data key (see crypto.py)."""

from __future__ import annotations

import uuid

from django.db import models

from apps.accounts.models import Group, Project, User


class DataKey(models.Model):
    """The tenant's data key, wrapped by the master key named by master_key_id. One row per tenant."""

    wrapped = models.BinaryField()
    master_key_id = models.CharField(max_length=16)
    created_at = models.DateTimeField(auto_now_add=True)
    rotated_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"data key wrapped by {self.master_key_id}"


class Secret(models.Model):
    class Scope(models.TextChoices):
        TENANT = "tenant"
        PROJECT = "project"
        USER = "user"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    scope = models.CharField(max_length=10, choices=Scope.choices)
    project = models.ForeignKey(Project, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    owner = models.ForeignKey(User, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=128)  # the environment variable a task gets it as
    ciphertext = models.BinaryField()  # nonce + AES-GCM, bound to the tenant and this row
    created_by = models.ForeignKey(User, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # A tenant secret's audience: the groups whose members' tasks, and the projects whose tasks, may be
    # given it. Empty (the default): no task may. Project and user secrets go to their project's and
    # their owner's tasks.
    audience_groups = models.ManyToManyField(Group, blank=True, related_name="+")
    audience_projects = models.ManyToManyField(Project, blank=True, related_name="+")

    class Meta:
        ordering = ["scope", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["scope", "project", "owner", "name"], name="one_secret_per_name", nulls_distinct=False
            )
        ]

    def __str__(self) -> str:
        return f"{self.where}/{self.name}"

    @property
    def where(self) -> str:
        if self.scope == self.Scope.PROJECT and self.project is not None:
            return f"project/{self.project.name}"
        if self.scope == self.Scope.USER and self.owner is not None:
            return f"user/{self.owner.username}"
        return "tenant"
