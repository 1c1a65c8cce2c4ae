from __future__ import annotations

from django.urls import path

from apps.billing import apis

urlpatterns = [
    path("provider/billing/export/", apis.BillingExportView.as_view(), name="provider-billing-export"),
    path("provider/billing/pushes/", apis.BillingPushListView.as_view(), name="provider-billing-pushes"),
    path("provider/billing/prices/", apis.ProviderPricesView.as_view(), name="provider-billing-prices"),
    path(
        "provider/billing/reconciliation/",
        apis.ReconciliationView.as_view(),
        name="provider-billing-reconciliation",
    ),
]
