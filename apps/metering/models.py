"""The usage ledger of a tenant: one row per event, never changed; its rollups; its periods and prices.

GPU time is kept exactly: a GPU share is a whole number of 1/840 GPU units (840 is divisible by 1 to 8
and by 7, so whole GPUs, fractions and MIG slices are all whole numbers of units), and a segment's
GPU time is units x milliseconds, an integer. GPU-hours are that over 840 x 3,600,000. Costs are whole
nano-USD. Nothing in the ledger is a float.
"""

from __future__ import annotations

from django.db import models

from apps.core.models import Totals


class Kind(models.TextChoices):
    GPU = "gpu"  # a run segment: a task's GPUs from when it started running to when it stopped
    TOKENS = "tokens"  # one gateway call
    STORAGE = "storage"  # bytes kept over a span of time (task outputs)
    INSTANCE = "instance"  # a cloud instance's time while it ran work (its provider bills it)
    IDLE = "idle"  # a cloud instance's time without work: booting, idle, being ended (billed all the same)


INSTANCE_KINDS = frozenset({Kind.INSTANCE, Kind.IDLE})


class Period(models.Model):
    """A billing month. Events land in the month they ended in while it is open; once it is closed,
    late events land in the oldest open month, marked late."""

    start = models.DateField(primary_key=True)  # the first day of the month
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["start"]

    def __str__(self) -> str:
        return f"{self.start:%Y-%m}"


class LedgerEvent(models.Model):
    """One metered event, written once (by event id) and never changed."""

    event_id = models.CharField(max_length=128, primary_key=True)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    digest = models.CharField(max_length=64)  # of the event's content: a replay must match it
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()  # = started_at for a gateway call
    period = models.DateField(db_index=True)
    late = models.BooleanField(default=False)  # arrived after its own period was closed
    user_id = models.UUIDField(null=True)
    username = models.CharField(max_length=150)
    project_id = models.UUIDField(null=True)
    project_name = models.CharField(max_length=100, blank=True)
    cost_center = models.CharField(max_length=100, blank=True)
    group_name = models.CharField(max_length=100, blank=True)
    pool = models.CharField(max_length=100, blank=True)
    gpu_class = models.CharField(max_length=50, blank=True)
    compute_resource = models.CharField(max_length=200, blank=True)
    gpu_units = models.PositiveIntegerField(default=0)  # 1/840 GPU
    gpu_unit_ms = models.BigIntegerField(default=0)  # units x milliseconds
    model = models.CharField(max_length=100, blank=True)
    tokens_in = models.BigIntegerField(default=0)
    tokens_out = models.BigIntegerField(default=0)
    byte_ms = models.BigIntegerField(default=0)  # bytes x milliseconds, for storage
    instance_type = models.CharField(max_length=100, blank=True)  # a cloud instance's, for instance and idle
    instance_ms = models.BigIntegerField(default=0)  # a cloud instance's milliseconds, for instance and idle
    cost_nano_usd = models.BigIntegerField(default=0)
    source = models.CharField(max_length=20)  # scheduler, gateway, storage, import
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["started_at"]
        indexes = [
            models.Index(fields=["project_id", "started_at"]),
            models.Index(fields=["user_id", "started_at"]),
        ]

    def __str__(self) -> str:
        return self.event_id


class Rejection(models.Model):
    """An event the ledger refused, with why: never merged, never dropped without a trace."""

    id = models.BigAutoField(primary_key=True)
    event_id = models.CharField(max_length=128, db_index=True)
    reason = models.TextField()
    payload = models.JSONField()
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.event_id}: {self.reason}"


class Rollup(Totals):
    """Sums of the ledger per hour and per day, by project, user, pool and GPU class (kept at ingest)."""

    class Grain(models.TextChoices):
        HOUR = "hour"
        DAY = "day"

    id = models.BigAutoField(primary_key=True)
    grain = models.CharField(max_length=4, choices=Grain.choices)
    bucket = models.DateTimeField()
    kind = models.CharField(max_length=10, choices=Kind.choices)
    project_id = models.UUIDField(null=True)
    user_id = models.UUIDField(null=True)
    pool = models.CharField(max_length=100, blank=True)
    gpu_class = models.CharField(max_length=50, blank=True)
    model = models.CharField(max_length=100, blank=True)

    class Meta:
        ordering = ["grain", "bucket"]
        constraints = [
            models.UniqueConstraint(
                fields=["grain", "bucket", "kind", "project_id", "user_id", "pool", "gpu_class", "model"],
                nulls_distinct=False,
                name="one_rollup_per_bucket_and_key",
            )
        ]

    def __str__(self) -> str:
        return f"{self.grain} {self.bucket:%Y-%m-%d %H:00} {self.kind}"


class PriceBook(models.Model):
    """The tenant's prices (one row, pk 1): GPU classes per GPU-hour, models per million tokens (in and
    out), storage per GB-month (30 days), cloud instance types per instance-hour, all in USD."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    gpu_hour = models.JSONField(default=dict)  # {"H100": "2.50", "*": "1.00"}
    tokens_million = models.JSONField(default=dict)  # {"chat": {"in": "0.15", "out": "0.60"}}
    gb_month = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    instance_hour = models.JSONField(default=dict)  # cloud instance types: {"g5.xlarge": "1.006", "*": "2"}
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return "price book"
