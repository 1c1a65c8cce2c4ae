"""URLs of the provider's own domain (the base domain, public schema)."""

from __future__ import annotations

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.accounts.urls import identity_urlpatterns
from apps.billing.urls import urlpatterns as billing_urlpatterns
from apps.portal.provider_urls import urlpatterns as center_urlpatterns
from apps.provider.urls import provider_urlpatterns

api_v1 = [*provider_urlpatterns, *billing_urlpatterns, *identity_urlpatterns]

urlpatterns = [
    path("api/v1/", include(api_v1)),
    *center_urlpatterns,
    path("api/schema/", SpectacularAPIView.as_view(urlconf="config.urls_public"), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]

handler404 = "apps.core.views.not_found"
handler500 = "apps.core.views.server_error"
