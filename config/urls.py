"""URLs of a tenant's domain (<tenant>.<base domain>): each app's API under api/v1/, the agents' uploads,
the sign-in pages, the portal and the API's schema."""

from __future__ import annotations

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.accounts.urls import urlpatterns as accounts_urlpatterns
from apps.catalogue.urls import address_urlpatterns
from apps.catalogue.urls import agent_urlpatterns as catalogue_agent_urlpatterns
from apps.catalogue.urls import urlpatterns as catalogue_urlpatterns
from apps.configuration.urls import urlpatterns as configuration_urlpatterns
from apps.fleet.urls import agent_urlpatterns
from apps.fleet.urls import urlpatterns as fleet_urlpatterns
from apps.mcp.urls import urlpatterns as mcp_urlpatterns
from apps.metering.urls import urlpatterns as metering_urlpatterns
from apps.portal.urls import urlpatterns as portal_urlpatterns
from apps.provider.urls import tenant_urlpatterns
from apps.scheduling.urls import urlpatterns as scheduling_urlpatterns
from apps.sso.urls import sign_in_urlpatterns
from apps.sso.urls import urlpatterns as sso_urlpatterns
from apps.vault.urls import urlpatterns as vault_urlpatterns
from gateway.urls import urlpatterns as gateway_urlpatterns

api_v1 = [
    *tenant_urlpatterns,
    *accounts_urlpatterns,
    *configuration_urlpatterns,
    *scheduling_urlpatterns,
    *fleet_urlpatterns,
    *catalogue_urlpatterns,
    *vault_urlpatterns,
    *sso_urlpatterns,
    *gateway_urlpatterns,
    *metering_urlpatterns,
    *mcp_urlpatterns,
]

urlpatterns = [
    path("api/v1/", include(api_v1)),
    *portal_urlpatterns,
    *agent_urlpatterns,
    *catalogue_agent_urlpatterns,
    *address_urlpatterns,
    *sign_in_urlpatterns,
    path("api/schema/", SpectacularAPIView.as_view(urlconf="config.urls"), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]

handler404 = "apps.core.views.not_found"
handler500 = "apps.core.views.server_error"
