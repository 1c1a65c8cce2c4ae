from __future__ import annotations

from django.urls import path

from apps.metering import apis

urlpatterns = [
    path("usage/", apis.UsageListView.as_view(), name="usage-list"),
    path("usage/summary/", apis.UsageSummaryView.as_view(), name="usage-summary"),
    path("usage/events/", apis.UsageImportView.as_view(), name="usage-import"),
    path("usage/rejections/", apis.RejectionListView.as_view(), name="usage-rejections"),
    path("usage/periods/", apis.PeriodListView.as_view(), name="usage-periods"),
    path("usage/periods/<str:period>/close/", apis.PeriodCloseView.as_view(), name="usage-period-close"),
    path("usage/chargeback/", apis.ChargebackView.as_view(), name="usage-chargeback"),
    path("price-book/", apis.PriceBookView.as_view(), name="price-book"),
]
