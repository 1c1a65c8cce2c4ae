from __future__ import annotations

from django.urls import path

from apps.fleet import apis as fleet
from apps.resources import apis as resources
from apps.scheduling import apis

urlpatterns = [
    path("configuration/", resources.ActiveConfigurationView.as_view(), name="configuration"),
    path("configuration/draft/", resources.DraftView.as_view(), name="configuration-draft"),
    path(
        "configuration/draft/validate/", resources.DraftValidateView.as_view(), name="configuration-validate"
    ),
    path(
        "configuration/draft/provision/",
        resources.DraftProvisionView.as_view(),
        name="configuration-provision",
    ),
    path(
        "configuration/draft/simulate/", resources.DraftSimulateView.as_view(), name="configuration-simulate"
    ),
    path("pools/", resources.PoolListView.as_view(), name="pool-list"),
    path("compute-resources/", resources.ComputeResourceListView.as_view(), name="compute-resource-list"),
    path(
        "compute-resources/<uuid:resource_id>/",
        resources.ComputeResourceDetailView.as_view(),
        name="compute-resource-detail",
    ),
    path(
        "compute-resources/<uuid:resource_id>/batch-preview/",
        resources.BatchPreviewView.as_view(),
        name="compute-resource-batch-preview",
    ),
    path("pools/<uuid:pool_id>/queue/", resources.PoolQueueView.as_view(), name="pool-queue"),
    path("queue-wait/", apis.QueueWaitView.as_view(), name="queue-wait"),
    path("tasks/", apis.TaskListView.as_view(), name="task-list"),
    path("tasks/<uuid:task_id>/", apis.TaskDetailView.as_view(), name="task-detail"),
    path("tasks/<uuid:task_id>/cancel/", apis.TaskCancelView.as_view(), name="task-cancel"),
    path("tasks/<uuid:task_id>/why/", apis.TaskWhyView.as_view(), name="task-why"),
    path("tasks/<uuid:task_id>/history/", apis.TaskHistoryView.as_view(), name="task-history"),
    path("tasks/<uuid:task_id>/logs/", fleet.TaskLogsView.as_view(), name="task-logs"),
    path("tasks/<uuid:task_id>/metrics/", fleet.TaskMetricsView.as_view(), name="task-metrics"),
    path("tasks/<uuid:task_id>/outputs/", fleet.TaskOutputListView.as_view(), name="task-outputs"),
    path(
        "tasks/<uuid:task_id>/outputs/<path:name>", fleet.TaskOutputDownloadView.as_view(), name="task-output"
    ),
    path("pools/<uuid:pool_id>/agent-tokens/", fleet.PoolAgentTokensView.as_view(), name="pool-agent-tokens"),
    path("agent-tokens/<uuid:token_id>/", fleet.AgentTokenDetailView.as_view(), name="agent-token-detail"),
]
