from __future__ import annotations

from django.apps import AppConfig


class CatalogueConfig(AppConfig):
    name = "apps.catalogue"
    label = "catalogue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.catalogue import signals  # noqa: F401 -- starts a sleeping model's app when it is called
