from __future__ import annotations

from django.apps import AppConfig


class ProviderConfig(AppConfig):
    """The provider's side of Klique: tenants' lifecycle, the Platform Management Center's API, and the
    provider's commands (`tenant`, `provider_admin`, `demo_setup`). No tables: tenants live in `tenants`."""

    name = "apps.provider"
    label = "provider"
