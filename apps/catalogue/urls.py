"""The catalogue's API: entries and apps."""

from __future__ import annotations

from django.urls import path

from apps.catalogue import apis, views

urlpatterns = [
    path("catalogue/", apis.CatalogueView.as_view(), name="catalogue"),
    path("apps/", apis.AppListView.as_view(), name="app-list"),
    path("apps/<uuid:app_id>/", apis.AppDetailView.as_view(), name="app-detail"),
    path("apps/<uuid:app_id>/stop/", apis.AppStopView.as_view(), name="app-stop"),
    path("apps/<uuid:app_id>/start/", apis.AppStartView.as_view(), name="app-start"),
]

# An app's stable address on the tenant's host (apps.catalogue.views).
address_urlpatterns = [
    path("apps/<uuid:app_id>/", views.address, name="app-address"),
    path("apps/<uuid:app_id>/<path:rest>", views.address, name="app-address-path"),
]

# A Slurm cluster's controller asks for its worker nodes (apps.catalogue.slurm), with its task token.
agent_urlpatterns = [
    path("agents/v1/tasks/<uuid:task_id>/slurm/", views.slurm_workers, name="agent-slurm-workers"),
]
