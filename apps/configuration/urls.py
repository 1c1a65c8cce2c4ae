"""The configuration API: the configuration document, pools, compute resources and their queues."""

from __future__ import annotations

from django.urls import path

from apps.configuration import apis

urlpatterns = [
    path("configuration/", apis.ActiveConfigurationView.as_view(), name="configuration"),
    path("configuration/draft/", apis.DraftView.as_view(), name="configuration-draft"),
    path("configuration/draft/validate/", apis.DraftValidateView.as_view(), name="configuration-validate"),
    path(
        "configuration/draft/provision/",
        apis.DraftProvisionView.as_view(),
        name="configuration-provision",
    ),
    path("configuration/draft/simulate/", apis.DraftSimulateView.as_view(), name="configuration-simulate"),
    path("pools/", apis.PoolListView.as_view(), name="pool-list"),
    path("compute-resources/", apis.ComputeResourceListView.as_view(), name="compute-resource-list"),
    path(
        "compute-resources/<uuid:resource_id>/",
        apis.ComputeResourceDetailView.as_view(),
        name="compute-resource-detail",
    ),
    path(
        "compute-resources/<uuid:resource_id>/batch-preview/",
        apis.BatchPreviewView.as_view(),
        name="compute-resource-batch-preview",
    ),
    path("pools/<uuid:pool_id>/queue/", apis.PoolQueueView.as_view(), name="pool-queue"),
]
