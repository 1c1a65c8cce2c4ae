from __future__ import annotations

from django.apps import AppConfig


class SsoConfig(AppConfig):
    name = "apps.sso"
    label = "sso"
    default_auto_field = "django.db.models.BigAutoField"
