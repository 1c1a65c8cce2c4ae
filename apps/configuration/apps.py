from __future__ import annotations

from django.apps import AppConfig


class ConfigurationConfig(AppConfig):
    """A tenant's configuration at work: the draft document (edit, validate, simulate, provision), and the
    API over pools, compute resources and their queues. No tables: what it edits is apps.resources'."""

    name = "apps.configuration"
    label = "configuration"
