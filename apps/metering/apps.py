from __future__ import annotations

from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "apps.metering"
    label = "metering"
    default_auto_field = "django.db.models.BigAutoField"
