"""Tasks and their history."""

from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone

from apps.accounts.models import Project, User
from apps.resources.models import ComputeResource, Pool, ResourcePolicy, TaskSharing


class TaskState(models.TextChoices):
    QUEUED = "queued"
    PLACED = "placed"  # the scheduler chose a pool; the pool's agent has not taken it yet
    DISPATCHING = "dispatching"  # handed to the agent under a lease
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"
    PREEMPTED = "preempted"  # passes straight back to queued, at the front; kept in the history


ACTIVE_STATES = (TaskState.PLACED, TaskState.DISPATCHING, TaskState.RUNNING)
ENDED_STATES = (TaskState.COMPLETED, TaskState.FAILED, TaskState.ABORTED)


class Task(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, blank=True)
    compute_resource = models.ForeignKey(
        ComputeResource, null=True, blank=True, on_delete=models.SET_NULL, related_name="tasks"
    )
    compute_resource_name = models.CharField(max_length=200)  # kept when the compute resource is removed
    submitter = models.ForeignKey(User, on_delete=models.PROTECT, related_name="tasks")
    project = models.ForeignKey(
        Project, null=True, blank=True, on_delete=models.SET_NULL, related_name="tasks"
    )
    size_units = models.PositiveIntegerField()
    nodes = models.PositiveSmallIntegerField(default=1)
    sharing = models.CharField(max_length=16, choices=TaskSharing.choices, default=TaskSharing.WHOLE)
    priority = models.IntegerField(default=0)
    # How long a run may last; past it the run is stopped with a grace period (lifecycle). None: no
    # limit, and then its end cannot be planned, so it never holds back a waiting task's backfill.
    time_limit_seconds = models.PositiveIntegerField(null=True, blank=True)
    # The token it was submitted with, when that was an AI agent's delegated token (its quota counts it).
    submitted_with = models.ForeignKey(
        "accounts.ApiToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    submitted_by_agent = models.CharField(max_length=100, blank=True)  # kept when the token is gone
    # The submitter's own key for this submission: the same key again returns this task, never a second.
    idempotency_key = models.CharField(max_length=100, blank=True, default="")
    spec = models.JSONField(default=dict, blank=True)  # what to run; the agent renders it

    state = models.CharField(
        max_length=16, choices=TaskState.choices, default=TaskState.QUEUED, db_index=True
    )
    reason_code = models.CharField(max_length=40, blank=True)
    reason = models.TextField(blank=True)
    pool = models.ForeignKey(Pool, null=True, blank=True, on_delete=models.SET_NULL, related_name="tasks")
    attempts = models.PositiveSmallIntegerField(default=0)
    max_attempts = models.PositiveSmallIntegerField(default=3)
    exit_code = models.IntegerField(null=True, blank=True)
    # The agent's hold on a task it was handed; unacknowledged by lease_expires_at, it goes back to the queue.
    lease_id = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)

    # Order in the queue: a preempted task keeps submitted_at, and so returns to the front.
    submitted_at = models.DateTimeField()
    queued_at = models.DateTimeField()  # when it last entered the queue: queue wait is measured from here
    placed_at = models.DateTimeField(null=True, blank=True)
    wait_seconds = models.FloatField(null=True, blank=True)  # queued_at to placed_at, of the last placement
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    # How far the running run's GPU time is in the ledger: it is metered hour by hour while it runs
    # (apps.scheduling.meter.meter_running), and the rest when it stops.
    metered_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-submitted_at"]
        indexes = [models.Index(fields=["compute_resource", "state"]), models.Index(fields=["state", "pool"])]
        constraints = [
            models.UniqueConstraint(
                fields=["submitter", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="task_idempotency_key_per_submitter",
            )
        ]

    def __str__(self) -> str:
        return self.name or str(self.id)


class TaskEvent(models.Model):
    """One change of a task's state: who, what, when."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField()
    actor = models.CharField(max_length=200)  # a username, or "scheduler"
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["at", "id"]
        # The dashboard's event log reads the latest events of the whole tenant on every load.
        indexes = [models.Index(fields=["at"], name="taskevent_at")]

    def __str__(self) -> str:
        return f"{self.task_id}: {self.from_state} -> {self.to_state}"


class RunOutcome(models.TextChoices):
    LIVE = "", "live"  # dispatched or running, the task's current run
    COMPLETED = "completed"
    FAILED = "failed"
    REFUSED = "refused"  # the agent rejected the assignment
    EXPIRED = "expired"  # not acknowledged in time
    LOST = "lost"  # its agent went silent, or no longer had it; kept if the agent comes back with it
    STOPPED = "stopped"  # aborted or preempted
    DUPLICATE = "duplicate"  # it ran although the task had started another run meanwhile
    HANDED = "handed"  # a cloud pool's autoscaler handed it on to an instance's agent, as the next run


class TaskRun(models.Model):
    """One attempt of a task on one agent, under its lease: the fencing token every report names.

    The plane applies a report only to the lease it names. A run keeps its agent, so reconciliation at
    hello concerns that agent's runs alone (a pool may have several agents). `stop` is desired state: an
    abort or preempt the plane keeps asking for until the agent no longer holds the run; `released_at`
    is when the agent said so, and until then the run's GPUs are not handed to anything else."""

    lease_id = models.UUIDField(primary_key=True)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="runs")
    attempt = models.PositiveSmallIntegerField()  # the n-th dispatch of the task
    pool = models.ForeignKey(Pool, null=True, on_delete=models.SET_NULL, related_name="runs")
    agent_id = models.CharField(max_length=100, blank=True)
    size_units = models.PositiveIntegerField(default=0)
    dispatched_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    outcome = models.CharField(max_length=12, choices=RunOutcome.choices, default=RunOutcome.LIVE, blank=True)
    note = models.TextField(blank=True)  # what happened to it, for the task's page
    stop = models.CharField(max_length=10, blank=True)  # "abort" or "preempt", until the agent lets it go
    stop_grace_seconds = models.FloatField(default=0.0)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["task", "attempt"]
        indexes = [
            models.Index(
                fields=["agent_id"], name="live_runs_by_agent", condition=models.Q(released_at=None)
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_id} attempt {self.attempt} ({self.lease_id})"


class WaitObjective(models.Model):
    """A published queue-wait objective: `percentile` of the waits of a policy's (or one compute
    resource's) tasks, over the last `window_seconds`, within `target_seconds`; optionally only for tasks
    of `min_units` to `max_units`. Its state is kept so that each change is announced once."""

    class State(models.TextChoices):
        OK = "ok"
        AT_RISK = "at_risk"  # the error budget burns fast enough to be gone before the window ends
        BREACHED = "breached"  # more tasks waited too long than the objective allows

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=100, unique=True)
    policy = models.ForeignKey(
        ResourcePolicy, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    compute_resource = models.ForeignKey(
        ComputeResource, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    percentile = models.FloatField()
    target_seconds = models.PositiveIntegerField()
    window_seconds = models.PositiveIntegerField()
    min_units = models.PositiveIntegerField(null=True, blank=True)
    max_units = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.OK)
    state_since = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(policy__isnull=True) ^ models.Q(compute_resource__isnull=True),
                name="objective_of_one_scope",
            )
        ]

    def __str__(self) -> str:
        return self.name


class WaitObjectiveSample(models.Model):
    """How an objective stood in one hour (its last measurement of that hour), for its trend; kept as long
    as the longest window an objective may have."""

    objective = models.ForeignKey(WaitObjective, on_delete=models.CASCADE, related_name="samples")
    hour = models.DateTimeField()
    value_seconds = models.FloatField(null=True)
    target_seconds = models.PositiveIntegerField()  # as set then: a changed target leaves the past alone
    attainment = models.FloatField(null=True)
    error_budget_left = models.FloatField(null=True)
    state = models.CharField(max_length=10, choices=WaitObjective.State.choices)

    class Meta:
        ordering = ["hour"]
        constraints = [models.UniqueConstraint(fields=["objective", "hour"], name="one_sample_an_hour")]

    def __str__(self) -> str:
        return f"{self.objective_id} at {self.hour:%Y-%m-%d %H:00}"


class EventWebhook(models.Model):
    """A tenant's HTTPS endpoint that is sent announcements (queue-wait objectives' changes of state),
    signed with a vault secret's value (HMAC-SHA256), retried until it answers."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    url = models.CharField(max_length=500)
    secret_name = models.CharField(max_length=128)  # a tenant secret: the signing key, never stored here
    kinds = models.JSONField(default=list)  # event kinds it is sent ("slo.breached"); [] for all
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at"]

    def __str__(self) -> str:
        return self.url


class WebhookDelivery(models.Model):
    """One announcement to one webhook: sent until it is answered 2xx, at most MAX_ATTEMPTS times."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"  # given up after its attempts; kept with the last error

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    webhook = models.ForeignKey(EventWebhook, on_delete=models.CASCADE, related_name="deliveries")
    kind = models.CharField(max_length=50)
    payload = models.JSONField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING, db_index=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    last_error = models.CharField(max_length=500, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.kind} to {self.webhook_id} ({self.status})"
