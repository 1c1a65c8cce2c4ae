"""URLs of a tenant's domain (<tenant>.<base domain>)."""

from __future__ import annotations

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.accounts.urls import urlpatterns as accounts_urlpatterns
from apps.fleet.apis import agent_output_upload, agent_reports_post
from apps.metering.urls import urlpatterns as metering_urlpatterns
from apps.portal.urls import urlpatterns as portal_urlpatterns
from apps.scheduling.urls import urlpatterns as scheduling_urlpatterns
from apps.sso import views as sso
from apps.vault.urls import urlpatterns as vault_urlpatterns
from gateway.urls import urlpatterns as gateway_urlpatterns
from tenants.urls import tenant_urlpatterns

api_v1 = [
    *tenant_urlpatterns,
    *accounts_urlpatterns,
    *scheduling_urlpatterns,
    *vault_urlpatterns,
    *gateway_urlpatterns,
    *metering_urlpatterns,
]

urlpatterns = [
    path("api/v1/", include(api_v1)),
    *portal_urlpatterns,
    path(
        "agents/v1/tasks/<uuid:task_id>/outputs/<path:name>", agent_output_upload, name="agent-output-upload"
    ),
    path("agents/v1/tasks/<uuid:task_id>/reports/", agent_reports_post, name="agent-reports"),
    path("auth/sso/login/", sso.SignIn.as_view(), name="oidc_authentication_init"),
    path("auth/sso/callback/", sso.Callback.as_view(), name="oidc_authentication_callback"),
    path("auth/logout/", sso.sign_out, name="sign-out"),
    path("auth/login/", sso.password_sign_in, name="password-sign-in"),
    path("api/schema/", SpectacularAPIView.as_view(urlconf="config.urls"), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]

handler404 = "apps.core.views.not_found"
handler500 = "apps.core.views.server_error"
