from __future__ import annotations

from django.urls import path

from apps.portal import provider, views

urlpatterns = [
    path("portal/sign-in/", provider.sign_in, name="pmc-sign-in"),
    path("portal/sign-out/", views.sign_out, name="pmc-sign-out"),
    path("portal/", provider.center, name="pmc"),
    path("portal/tenants/", provider.tenant_create, name="pmc-tenant-create"),
    path("portal/tenants/table/", provider.tenants_table, name="pmc-tenants-table"),
    path("portal/tenants/<slug:slug>/suspend/", provider.tenant_suspend, name="pmc-tenant-suspend"),
]
