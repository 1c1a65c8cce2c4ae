from __future__ import annotations

from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "apps.fleet"
    label = "fleet"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from apps.fleet import selectors  # models are loaded only now
        from apps.scheduling import agents

        agents.register(selectors.AGENTS)
