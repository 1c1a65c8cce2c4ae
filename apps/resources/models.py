"""Where work may run: pools, resource profiles, resource policies and the compute resources that connect
them. These tables hold the provisioned configuration; administrators edit a draft document
(ConfigurationDraft) and provision it, which rewrites these rows in one transaction (see services.py).

Sizes are stored in units of 1/840 GPU (apps.scheduling.engine.units), so fractions and MIG slices are
exact.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from django.db import models

from apps.accounts.models import Group, Project, User
from apps.scheduling.engine import to_gpus_text


class Environment(models.TextChoices):
    KUBERNETES = "kubernetes"
    SLURM = "slurm"
    PBS = "pbs"
    LSF = "lsf"
    BAREMETAL = "baremetal"
    CLOUD = "cloud"
    NEOCLOUD = "neocloud"


# Autoscaled capacity: online with zero instances while its autoscaler heartbeats (it scales from zero).
SCALES_FROM_ZERO = frozenset({Environment.CLOUD, Environment.NEOCLOUD})


class SharingMethod(models.TextChoices):
    WHOLE = "whole"
    FRACTION = "fraction"
    MIG_STATIC = "mig_static"
    MIG_DYNAMIC = "mig_dynamic"
    AMD_PARTITION = "amd_partition"


MIG_METHODS = frozenset({SharingMethod.MIG_STATIC, SharingMethod.MIG_DYNAMIC})


class TaskSharing(models.TextChoices):
    """How a profile's tasks use GPUs."""

    WHOLE = "whole"
    FRACTION = "fraction"
    MIG = "mig"


class Pool(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=100, unique=True)
    environment = models.CharField(max_length=16, choices=Environment.choices)
    capacity_gpus = models.PositiveIntegerField()
    gpu_class = models.CharField(max_length=50, blank=True)
    region = models.CharField(max_length=50, blank=True)
    sharing = models.JSONField(default=list)  # SharingMethod values
    cost_tier = models.PositiveSmallIntegerField(default=0)
    heartbeat_timeout_seconds = models.PositiveIntegerField(default=90)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def is_online(self, now: datetime) -> bool:
        """An agent of the pool heartbeats within its timeout; for a cloud pool, its autoscaler, which makes
        the pool online with no instance at all."""
        return online(self.last_heartbeat_at, self.heartbeat_timeout_seconds, now)


def online(last_heartbeat_at: datetime | None, heartbeat_timeout_seconds: int, now: datetime) -> bool:
    """Whether a pool with this last heartbeat and timeout is online at `now` (`Pool.is_online`, for a pool
    read as plain values)."""
    if last_heartbeat_at is None:
        return False
    return now - last_heartbeat_at <= timedelta(seconds=heartbeat_timeout_seconds)


MIN_TIME_LIMIT_SECONDS = 60  # a task's time limit: at least a minute
MAX_TIME_LIMIT_SECONDS = 30 * 86_400  # and at most 30 days


class ResourceProfile(models.Model):
    """A task size and an ordered list of pools.

    The size is fixed (size_units, with nodes x gpus_per_node for multi-node work) or read from each task
    within [min_units, max_units] when size_from_task is set.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=100, unique=True)
    display_name = models.CharField(max_length=200, blank=True)
    sharing = models.CharField(max_length=16, choices=TaskSharing.choices, default=TaskSharing.WHOLE)
    size_from_task = models.BooleanField(default=False)
    size_units = models.PositiveIntegerField(default=0)
    min_units = models.PositiveIntegerField(default=0)
    max_units = models.PositiveIntegerField(default=0)
    nodes = models.PositiveSmallIntegerField(default=1)
    mig_profile = models.CharField(max_length=20, blank=True)
    strict_fifo = models.BooleanField(default=False)
    starvation_seconds = models.PositiveIntegerField(null=True, blank=True)
    # Time limits: a task's default when it gives none, the most it may ask, whether it must have one.
    time_limit_default_seconds = models.PositiveIntegerField(null=True, blank=True)
    time_limit_max_seconds = models.PositiveIntegerField(null=True, blank=True)
    time_limit_required = models.BooleanField(default=False)
    pools = models.ManyToManyField(Pool, through="ProfilePool", related_name="profiles")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def size_text(self) -> str:
        """The size as a person reads it: "2 nodes, 8 GPUs", "1 GPUs (1g.10gb)", "0.25 to 1 GPUs, from the
        task"."""
        if self.size_from_task:
            return f"{to_gpus_text(self.min_units)} to {to_gpus_text(self.max_units)} GPUs, from the task"
        nodes = f"{self.nodes} nodes, " if self.nodes > 1 else ""
        mig = f" ({self.mig_profile})" if self.mig_profile else ""
        return f"{nodes}{to_gpus_text(self.size_units)} GPUs{mig}"


class ProfilePool(models.Model):
    profile = models.ForeignKey(ResourceProfile, on_delete=models.CASCADE, related_name="pool_order")
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="+")
    position = models.PositiveSmallIntegerField()
    execution_priority = models.IntegerField(default=0)

    class Meta:
        ordering = ["profile", "position"]
        constraints = [models.UniqueConstraint(fields=["profile", "pool"], name="pool_once_per_profile")]

    def __str__(self) -> str:
        return f"{self.profile_id} #{self.position}: {self.pool_id}"


class ResourcePolicy(models.Model):
    """A group's reservation (guaranteed) and limit (most at once, borrowing included), in units."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=100, unique=True)
    group = models.ForeignKey(Group, on_delete=models.PROTECT, related_name="policies")
    reservation_units = models.PositiveIntegerField(default=0)
    limit_units = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ComputeResource(models.Model):
    """The queue users submit to: one profile connected to one policy."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True)
    policy = models.ForeignKey(ResourcePolicy, on_delete=models.CASCADE, related_name="compute_resources")
    profile = models.ForeignKey(ResourceProfile, on_delete=models.CASCADE, related_name="compute_resources")
    queuing_priority = models.IntegerField(default=0)
    # Batch templates per scheduler for HPC pools: {"slurm": {"template", "allowed_directives",
    # "defaults"}, "pbs": ..., "lsf": ...}; a scheduler left out uses protocol.batch's default.
    batch = models.JSONField(default=dict, blank=True)
    # The projects whose work it is for; none: anyone's. A project limited to regions (data residency) may
    # be given a compute resource only if every pool of its profile is in one of those regions.
    projects = models.ManyToManyField(Project, blank=True, related_name="+")

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["policy", "profile"], name="one_queue_per_policy_profile")
        ]

    def __str__(self) -> str:
        return self.name


class ConfigurationDraft(models.Model):
    """The administrators' working copy of the configuration, as one document; one row per tenant."""

    document = models.JSONField(default=dict)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.ForeignKey(User, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    provisioned_at = models.DateTimeField(null=True, blank=True)
    provisioned_by = models.ForeignKey(
        User, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    def __str__(self) -> str:
        return f"configuration draft of {self.updated_at:%Y-%m-%d %H:%M}"
