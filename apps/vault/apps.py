from __future__ import annotations

from django.apps import AppConfig


class VaultConfig(AppConfig):
    name = "apps.vault"
    label = "vault"
    default_auto_field = "django.db.models.BigAutoField"
