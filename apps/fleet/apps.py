from __future__ import annotations

from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "apps.fleet"
    label = "fleet"
    default_auto_field = "django.db.models.BigAutoField"
