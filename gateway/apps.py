from __future__ import annotations

from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"
    label = "gateway"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.vault.services import register_platform_names
        from gateway import signals  # noqa: F401 -- connects the epoch bumps
        from gateway.services import upstream_key_names

        register_platform_names(upstream_key_names)  # upstream keys go to the gateway, never to a task
