"""The app catalogue: entries (versioned templates) and the instances of them people run."""

from __future__ import annotations

import secrets
import string
import uuid

from django.db import models

from apps.accounts.models import Group, Project, User
from apps.scheduling.models import Task

SLUG_ALPHABET = string.ascii_lowercase + string.digits


def new_slug() -> str:
    """The label of an instance's own host (app-<slug>.<tenant's host>): random, so not guessable."""
    return "".join(secrets.choice(SLUG_ALPHABET) for _ in range(16))


class CatalogueEntry(models.Model):
    """One version of an app's template, added by an administrator (the entries shipped with Klique are
    in apps.catalogue.shipped, not rows). A version is never changed: a new one is added."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=63)
    version = models.CharField(max_length=40)
    template = models.JSONField()  # protocol.apps.Template's document, as validated
    # Project admins may launch only entries an administrator allowed for projects.
    allowed_for_projects = models.BooleanField(default=True)
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "-created_at"]
        constraints = [models.UniqueConstraint(fields=["name", "version"], name="one_entry_per_version")]

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


class AppInstance(models.Model):
    """An app someone launched: the task that runs it (a new one on each start), who may reach it, and
    what its route knows of it."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    slug = models.CharField(max_length=16, unique=True, default=new_slug)
    name = models.CharField(max_length=100)
    entry_name = models.CharField(max_length=63)
    entry_version = models.CharField(max_length=40)
    template = models.JSONField()  # as it was launched: a later version of the entry changes nothing here
    variables = models.JSONField(default=dict)
    secrets = models.JSONField(
        default=list, blank=True
    )  # vault secret names its user added to the template's
    compute_resource_name = models.CharField(max_length=200)
    gpus = models.CharField(max_length=12)
    owner = models.ForeignKey(User, on_delete=models.CASCADE, related_name="apps")
    project = models.ForeignKey(
        Project, null=True, blank=True, on_delete=models.SET_NULL, related_name="apps"
    )
    shared_with_project = models.BooleanField(default=False)
    groups = models.ManyToManyField(Group, blank=True, related_name="apps")
    task = models.ForeignKey(Task, null=True, on_delete=models.SET_NULL, related_name="+")
    # The tunnel the route sends requests through: the plane channel of the agent's tunnel socket, and the
    # lease it was opened under. Cleared when it closes; only a tunnel of the task's live run is kept.
    tunnel_channel = models.CharField(max_length=200, blank=True)
    tunnel_lease = models.UUIDField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)  # the run's first health answer
    last_request_at = models.DateTimeField(null=True, blank=True)
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    stop_reason = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name


class ClusterWorker(models.Model):
    """A worker node of an app's Slurm cluster (protocol.clusters): the task that runs it, made when the
    cluster's controller woke the node, under the controller run it belongs to."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    app = models.ForeignKey(AppInstance, on_delete=models.CASCADE, related_name="workers")
    controller = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="+")
    controller_lease = models.UUIDField()  # the controller's run: a worker never outlives it
    node = models.CharField(max_length=80)
    task = models.OneToOneField(Task, on_delete=models.CASCADE, related_name="cluster_worker")
    made_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["made_at"]
        indexes = [models.Index(fields=["controller", "node"], name="worker_by_controller_node")]

    def __str__(self) -> str:
        return self.node
