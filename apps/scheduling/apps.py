from __future__ import annotations

from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "apps.scheduling"
    label = "scheduling"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from prometheus_client import REGISTRY

        from apps.scheduling.metrics import QueueCollector

        REGISTRY.register(QueueCollector())
