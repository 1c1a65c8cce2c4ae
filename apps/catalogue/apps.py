from __future__ import annotations

from django.apps import AppConfig


class CatalogueConfig(AppConfig):
    name = "apps.catalogue"
    label = "catalogue"
    default_auto_field = "django.db.models.BigAutoField"
