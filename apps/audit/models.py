"""The audit log: administrative actions and every read of a secret, one row each, never changed."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class AuditEvent(models.Model):
    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.CharField(max_length=200)  # a username, or "scheduler" for what the plane does itself
    on_behalf_of = models.CharField(max_length=200, blank=True)  # the user a dispatch or an agent acts for
    action = models.CharField(max_length=60, db_index=True)  # "secret.read", "configuration.provisioned"
    target = models.CharField(
        max_length=300
    )  # what it was done to, in words: "secret project/vision/HF_TOKEN"
    detail = models.JSONField(default=dict, blank=True)  # never a secret's value
    request_id = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"
