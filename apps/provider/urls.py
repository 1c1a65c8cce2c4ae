from __future__ import annotations

from django.urls import path

from apps.provider import apis

tenant_urlpatterns = [
    path("tenant/", apis.CurrentTenantView.as_view(), name="tenant"),
]

provider_urlpatterns = [
    path("provider/tenants/", apis.ProviderTenantListView.as_view(), name="provider-tenant-list"),
    path(
        "provider/tenants/<slug:slug>/",
        apis.ProviderTenantDetailView.as_view(),
        name="provider-tenant-detail",
    ),
    path(
        "provider/tenants/<slug:slug>/suspend/",
        apis.ProviderTenantSuspendView.as_view(),
        name="provider-tenant-suspend",
    ),
    path("provider/usage/", apis.ProviderUsageView.as_view(), name="provider-usage"),
    path(
        "provider/tenants/<slug:slug>/resume/",
        apis.ProviderTenantResumeView.as_view(),
        name="provider-tenant-resume",
    ),
]
