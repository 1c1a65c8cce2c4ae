"""Agents: the pool-scoped tokens they connect with, what each one is, and what they report per task.

An agent token opens one pool's websocket and nothing else: it cannot call the REST API, and it names
its pool, so an agent cannot pull another pool's work.
"""

from __future__ import annotations

import functools
import math
import uuid
from typing import Any

from django.db import connection, models
from django.utils import timezone

from apps.accounts.models import Project
from apps.core import deferred
from apps.resources.models import Pool
from apps.scheduling.models import Task


class AgentToken(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="agent_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # The agent the token is bound to since its first hello: the id it gave and a hash of its instance key.
    bound_agent_id = models.CharField(max_length=100, blank=True)
    bound_instance = models.CharField(max_length=64, blank=True)
    bound_at = models.DateTimeField(null=True, blank=True)
    # The last hello with this token from another agent (refused), for the pool's admins to see.
    conflict_at = models.DateTimeField(null=True, blank=True)
    conflict = models.CharField(max_length=300, blank=True)
    # A cloud instance's token, minted by its pool's autoscaler (whose token this is) for the instance's
    # agent alone (bound_agent_id is its name from the start). It must say hello before expires_at; it is
    # revoked when the instance ends, or with the autoscaler's own token.
    instance_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="instance_tokens"
    )
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"kqa_{self.prefix}"


class Agent(models.Model):
    """An agent process as it last introduced itself."""

    id = models.CharField(max_length=100, primary_key=True)  # chosen by the agent, stable across restarts
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="agents")
    token = models.ForeignKey(AgentToken, null=True, on_delete=models.SET_NULL, related_name="agents")
    backend = models.CharField(max_length=30)
    version = models.CharField(max_length=30, blank=True)
    inventory = models.JSONField(default=dict)
    connected = models.BooleanField(default=False)
    connected_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # An HPC agent's view of its cluster's queue (Klique's jobs: pending with the cluster's reason, or
    # running), as of its last heartbeat.
    queue = models.JSONField(default=list, blank=True)
    # What the agent's environment has, as it last said (its host, or its cluster's nodes): None where
    # it cannot say. CPUs in use are a host's load, or a cluster's CPUs allocated to jobs.
    cpus = models.PositiveIntegerField(null=True, blank=True)
    cpus_in_use = models.PositiveIntegerField(null=True, blank=True)
    nodes = models.PositiveIntegerField(null=True, blank=True)
    # GPUs per class and resource as a cluster's agent counts them: [{class, resource, allocatable,
    # allocated}] (a Kubernetes agent's nodes); [] where it does not say.
    gpus = models.JSONField(default=list, blank=True)
    # What stops the agent's environment from taking work, in its words ("" when nothing does).
    problem = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["pool__name", "id"]

    def __str__(self) -> str:
        return self.id


class CloudInstance(models.Model):
    """An instance a cloud pool's autoscaler started, as it last reported it (protocol.cloud)."""

    name = models.CharField(max_length=63, primary_key=True)  # its agent's id
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="instances")
    autoscaler = models.CharField(max_length=100)  # the autoscaler agent's id
    token = models.ForeignKey(AgentToken, null=True, on_delete=models.SET_NULL, related_name="+")
    provider_id = models.CharField(max_length=100, blank=True)
    instance_type = models.CharField(max_length=100, blank=True)
    gpus = models.PositiveSmallIntegerField(default=0)
    spot = models.BooleanField(default=False)
    region = models.CharField(max_length=100, blank=True)
    state = models.CharField(max_length=12, default="launching")
    reason = models.CharField(max_length=500, blank=True)
    launched_at = models.DateTimeField(default=timezone.now)
    state_since = models.DateTimeField(default=timezone.now)
    ended_at = models.DateTimeField(null=True, blank=True)
    # Its lifetime is metered up to here (instance-hours, busy and idle, into the ledger).
    metered_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["pool__name", "launched_at"]
        indexes = [models.Index(fields=["pool", "ended_at"], name="instances_by_pool")]

    def __str__(self) -> str:
        return self.name


class OutputDestination(models.Model):
    """Where a project's task outputs go instead of the plane's file store: an S3-compatible bucket (in the
    project's region, where it has regions). The bucket's credentials are two of the vault's secrets, named
    here, that the project's tasks may be given. Never changed in place: a new setting retires the current
    row and adds one, so that outputs stored under an earlier one are still found where they went."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    bucket = models.CharField(max_length=63)
    prefix = models.CharField(max_length=200, blank=True)  # "" or ending in "/"
    region = models.CharField(max_length=50)
    endpoint = models.CharField(max_length=300, blank=True)  # "" for AWS S3; else an S3-compatible store
    access_key_secret = models.CharField(max_length=128)  # vault secret names, never their values
    secret_key_secret = models.CharField(max_length=128)
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(default=timezone.now)
    retired_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["project"],
                condition=models.Q(retired_at__isnull=True),
                name="one_current_destination",
            )
        ]

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


class TaskOutput(models.Model):
    """A file a task declared as output, uploaded by its agent when the task ended."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="outputs")
    name = models.CharField(max_length=500)  # relative to the task's folder
    size = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    stored = models.CharField(max_length=1000)  # the name in the file store, or the key in the bucket
    # The project's bucket it went to; None: the plane's own file store.
    destination = models.ForeignKey(
        OutputDestination, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    at = models.DateTimeField(default=timezone.now)
    lease_id = models.UUIDField(null=True, blank=True)  # the run that wrote it: each run has its own set

    class Meta:
        ordering = ["task", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["task", "lease_id", "name"], name="one_output_per_run_name", nulls_distinct=False
            )
        ]

    def __str__(self) -> str:
        return f"{self.task_id}:{self.name}"


class TaskReport(models.Model):
    """One message about a task (status, log, metric or result), kept once per source and sequence
    number, so that a reconnecting agent may replay its outbox without anything counted twice.

    The source is "agent" for the pool's agent, and "node-<rank>" for an HPC job's node reporter, which
    numbers its own reports. Numbers start again with each run (lease): a retry's reports are its own.
    Logs are read in the order they were kept (the id)."""

    class Kind(models.TextChoices):
        STATUS = "status"
        LOG = "log"
        METRIC = "metric"
        RESULT = "result"

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="reports")
    source = models.CharField(max_length=40, default="agent")
    lease_id = models.UUIDField(null=True, blank=True)  # the run it is about; None before leases fenced
    seq = models.PositiveIntegerField()
    kind = models.CharField(max_length=10, choices=Kind.choices)
    body = models.JSONField(default=dict)
    at = models.DateTimeField(default=timezone.now)
    # A metric report's GPU utilization samples, counted and summed when it is saved: the dashboard
    # averages an hour of them for every running task, which must not mean reading each report's JSON.
    gpu_samples = models.PositiveIntegerField(default=0)
    gpu_percent_sum = models.FloatField(default=0.0)

    class Meta:
        ordering = ["task", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["task", "lease_id", "source", "seq"],
                name="one_report_per_run_source_seq",
                nulls_distinct=False,
            )
        ]
        indexes = [
            models.Index(fields=["at"], name="gpu_samples_by_time", condition=models.Q(gpu_samples__gt=0))
        ]

    def __str__(self) -> str:
        return f"{self.task_id}#{self.seq} {self.kind}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.count_gpu_samples()
        super().save(*args, **kwargs)

    def count_gpu_samples(self) -> None:
        if self.kind == self.Kind.METRIC:
            self.gpu_samples, self.gpu_percent_sum = gpu_utilization(self.body)

    def insert_once(self) -> bool:
        """Insert this report unless its run, source and number are kept already (a replay): one
        statement, `ON CONFLICT DO NOTHING`, where `save()` inside a savepoint would take three round
        trips for the same answer. Sets the id; False for a replay, which changes nothing."""
        self.count_gpu_samples()
        with connection.cursor() as cursor:
            cursor.execute(_insert_once_sql(), deferred.insert_values(self))
            row = cursor.fetchone()
        if row is None:
            return False
        self.pk = row[0]
        self._state.adding = False
        return True

    def insert_new(self, key: int) -> None:
        """Insert this report, known to be new, with the id taken for it (selectors.burst_report_new): with
        the next statement (apps.core.deferred), as nothing waits for its outcome."""
        self.count_gpu_samples()
        self.pk = key
        deferred.insert(self, keyed=True)
        self._state.adding = False


@functools.cache
def _insert_once_sql() -> str:
    quote = connection.ops.quote_name
    return (
        f"{deferred.insert_sql(TaskReport)} "
        "ON CONFLICT ON CONSTRAINT one_report_per_run_source_seq DO NOTHING "
        f"RETURNING {quote(str(TaskReport._meta.pk.column))}"
    )


def gpu_utilization(body: Any) -> tuple[int, float]:
    """How many GPU utilization samples a metric report's body holds, and their sum: each number at
    values.gpus[].utilization_percent (what node reporters and agents send); anything else is left out."""
    values = body.get("values") if isinstance(body, dict) else None
    gpus = values.get("gpus") if isinstance(values, dict) else None
    percents = [
        float(gpu["utilization_percent"])
        for gpu in (gpus if isinstance(gpus, list) else [])
        if isinstance(gpu, dict)
        and isinstance(gpu.get("utilization_percent"), int | float)
        and not isinstance(gpu["utilization_percent"], bool)
        and math.isfinite(gpu["utilization_percent"])
    ]
    return len(percents), sum(percents)
