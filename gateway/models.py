"""The gateway's tables in each tenant's schema: its configuration, its budgets, and the usage it wrote."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class GatewaySettings(models.Model):
    """The tenant's gateway configuration document (gateway.config reads it); one row, pk 1."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    document = models.JSONField(default=dict)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )

    def __str__(self) -> str:
        return "gateway settings"


class Budget(models.Model):
    """A limit on gateway spending for a user, a project or the whole tenant, per period or for good.

    A budget with period "none" is a wallet: it never resets, and a top-up raises its limit."""

    class Scope(models.TextChoices):
        TENANT = "tenant"
        PROJECT = "project"
        USER = "user"

    class Unit(models.TextChoices):
        TOKENS = "tokens"  # prompt and reply tokens together
        USD = "usd"  # cost at the deployments' prices

    class Period(models.TextChoices):
        DAY = "day"
        WEEK = "week"
        MONTH = "month"
        NONE = "none"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    scope = models.CharField(max_length=10, choices=Scope.choices)
    project = models.ForeignKey(
        "accounts.Project", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    unit = models.CharField(max_length=10, choices=Unit.choices, default=Unit.TOKENS)
    limit = models.DecimalField(max_digits=24, decimal_places=6)  # tokens, or USD
    period = models.CharField(max_length=10, choices=Period.choices, default=Period.MONTH)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["scope", "created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["scope", "project", "user", "unit", "period"],
                nulls_distinct=False,
                name="one_budget_per_subject_unit_and_period",
            ),
            models.CheckConstraint(
                condition=(
                    models.Q(scope="tenant", project__isnull=True, user__isnull=True)
                    | models.Q(scope="project", project__isnull=False, user__isnull=True)
                    | models.Q(scope="user", project__isnull=True, user__isnull=False)
                ),
                name="budget_names_its_subject",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.scope} budget {self.pk}"


class Usage(models.Model):
    """One gateway call as metered: who, which model, tokens in and out, cost. Written once per request id
    (the gateway's insert is ON CONFLICT DO NOTHING), so replaying a write never counts a call twice.
    Users and projects are kept by id and name, not by foreign key: usage outlives what it names."""

    class Status(models.TextChoices):
        OK = "ok"
        CUT = "cut"  # a stream stopped early: its budget ran out or a guardrail refused the reply
        REFUSED = "refused"  # the reply was made (and is paid for) but a guardrail withheld it
        FAILED = "failed"  # no deployment answered; nothing was spent

    request_id = models.CharField(max_length=64, primary_key=True)
    at = models.DateTimeField(db_index=True)
    user_id = models.UUIDField(db_index=True)
    username = models.CharField(max_length=150)
    project_id = models.UUIDField(null=True, db_index=True)
    project_name = models.CharField(max_length=100, blank=True)
    token_prefix = models.CharField(max_length=16, blank=True)
    agent = models.CharField(max_length=100, blank=True)  # a delegated token's agent
    endpoint = models.CharField(max_length=32)  # chat.completions, completions, embeddings
    model = models.CharField(max_length=100)  # the model group called
    deployment = models.CharField(max_length=200, blank=True)  # which deployment answered
    tokens_in = models.PositiveIntegerField(default=0)
    tokens_out = models.PositiveIntegerField(default=0)
    cost_nano_usd = models.BigIntegerField(default=0)  # exact: 10^-9 USD
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.OK)
    duration_ms = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return self.request_id


class SelfHosted(models.Model):
    """A model served by one of the tenant's apps (apps.catalogue), registered as a deployment of the
    model group `model_name` while the app runs. The gateway reaches it through the app's tunnel, for the
    people the app is shared with: its owner, its project's members where it is shared with the project,
    and the members of its groups.

    `asleep`: the app was stopped for idleness and scales to zero; the model stays listed and the next
    call to it starts the app again (apps.catalogue answers gateway.signals.selfhosted_wanted)."""

    class State(models.TextChoices):
        STARTING = "starting"
        READY = "ready"
        ASLEEP = "asleep"

    app_id = models.UUIDField(primary_key=True)
    task_id = models.UUIDField(null=True)  # the app's task now: only its end takes the model out
    label = models.CharField(max_length=100)  # the app's name, for messages
    model_name = models.CharField(max_length=100, db_index=True)  # the group, as callers name it
    served_model = models.CharField(max_length=100)  # the name the server knows
    mode = models.CharField(max_length=12, default="chat")
    input_cost_per_million = models.DecimalField(max_digits=18, decimal_places=6, default=0)
    output_cost_per_million = models.DecimalField(max_digits=18, decimal_places=6, default=0)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    project = models.ForeignKey(
        "accounts.Project", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )  # set where the app is shared with its project
    group_ids = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.STARTING)
    channel = models.CharField(max_length=200, blank=True)  # the app's tunnel, while one is open
    startup_seconds = models.PositiveIntegerField(default=300)
    last_call_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model_name", "created_at"]

    def __str__(self) -> str:
        return f"{self.model_name} on {self.label}"


class Session(models.Model):
    """A run's gateway session (protocol.sessions): the key its task was given, by hash, for as long as
    the run lasts. Opened at dispatch (apps.fleet), deleted when the run ends, which kills the key."""

    task_id = models.UUIDField(primary_key=True)
    key_hash = models.CharField(max_length=64)  # sha256 of the key; the run's key replaces an earlier run's
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    project = models.ForeignKey(
        "accounts.Project", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    label = models.CharField(max_length=100)  # what the usage rows and the audit call the session
    tokens = models.PositiveBigIntegerField()  # the quota: prompt and reply tokens together
    opened_at = models.DateTimeField()

    def __str__(self) -> str:
        return self.label
