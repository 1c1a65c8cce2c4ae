from __future__ import annotations

from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    default_auto_field = "django.db.models.BigAutoField"
