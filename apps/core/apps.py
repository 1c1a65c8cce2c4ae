from __future__ import annotations

from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "apps.core"
    label = "core"

    def ready(self) -> None:
        from apps.core import schema  # noqa: F401 -- registers the bearer scheme with drf-spectacular
