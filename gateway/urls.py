from __future__ import annotations

from django.urls import path

from gateway import apis

urlpatterns = [
    path("gateway/", apis.GatewaySettingsView.as_view(), name="gateway-settings"),
    path("gateway/budgets/", apis.BudgetListView.as_view(), name="gateway-budget-list"),
    path("gateway/budgets/<uuid:budget_id>/", apis.BudgetDetailView.as_view(), name="gateway-budget-detail"),
    path(
        "gateway/budgets/<uuid:budget_id>/top-up/",
        apis.BudgetTopUpView.as_view(),
        name="gateway-budget-top-up",
    ),
    path("gateway/usage/", apis.UsageListView.as_view(), name="gateway-usage"),
]
