from __future__ import annotations

from django.urls import path

from apps.audit.apis import AuditListView
from apps.sso.apis import SsoView
from apps.vault import apis

urlpatterns = [
    path("secrets/", apis.SecretListView.as_view(), name="secret-list"),
    path("secrets/<uuid:secret_id>/", apis.SecretDetailView.as_view(), name="secret-detail"),
    path("audit/", AuditListView.as_view(), name="audit-list"),
    path("sso/", SsoView.as_view(), name="sso"),
]
