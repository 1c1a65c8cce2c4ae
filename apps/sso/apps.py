from __future__ import annotations

from django.apps import AppConfig


class SsoConfig(AppConfig):
    name = "apps.sso"
    label = "sso"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.sso.services import CLIENT_SECRET_NAME
        from apps.vault.services import register_platform_names

        register_platform_names(lambda: {CLIENT_SECRET_NAME})  # single sign-on's, never a task's
