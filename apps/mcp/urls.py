from __future__ import annotations

from django.urls import path

from apps.mcp import apis

urlpatterns = [
    path("delegations/", apis.DelegationListView.as_view(), name="delegation-list"),
    path("delegations/<uuid:token_id>/", apis.DelegationDetailView.as_view(), name="delegation-detail"),
    path(
        "delegations/<uuid:token_id>/revoke/", apis.DelegationRevokeView.as_view(), name="delegation-revoke"
    ),
]
