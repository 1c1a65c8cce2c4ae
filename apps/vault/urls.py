from __future__ import annotations

from django.urls import path

from apps.vault import apis

urlpatterns = [
    path("secrets/", apis.SecretListView.as_view(), name="secret-list"),
    path("secrets/<uuid:secret_id>/", apis.SecretDetailView.as_view(), name="secret-detail"),
]
