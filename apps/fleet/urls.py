"""The fleet's API: a task's logs, metrics and outputs, the pools' agent tokens; and the agents' own
uploads (outputs and reports, under agents/v1/, with the task's token)."""

from __future__ import annotations

from django.urls import path

from apps.fleet import apis

urlpatterns = [
    path("tasks/<uuid:task_id>/logs/", apis.TaskLogsView.as_view(), name="task-logs"),
    path("tasks/<uuid:task_id>/metrics/", apis.TaskMetricsView.as_view(), name="task-metrics"),
    path("tasks/<uuid:task_id>/outputs/", apis.TaskOutputListView.as_view(), name="task-outputs"),
    path(
        "tasks/<uuid:task_id>/outputs/<path:name>", apis.TaskOutputDownloadView.as_view(), name="task-output"
    ),
    path("projects/<uuid:project_id>/outputs/", apis.ProjectOutputsView.as_view(), name="project-outputs"),
    path("pools/<uuid:pool_id>/agent-tokens/", apis.PoolAgentTokensView.as_view(), name="pool-agent-tokens"),
    path("agent-tokens/<uuid:token_id>/", apis.AgentTokenDetailView.as_view(), name="agent-token-detail"),
    path("instances/", apis.CloudInstancesView.as_view(), name="cloud-instances"),
]

agent_urlpatterns = [
    path(
        "agents/v1/tasks/<uuid:task_id>/output-tickets/<path:name>",
        apis.agent_output_ticket,
        name="agent-output-ticket",
    ),
    path(
        "agents/v1/tasks/<uuid:task_id>/output-receipts/<path:name>",
        apis.agent_output_receipt,
        name="agent-output-receipt",
    ),
    path(
        "agents/v1/tasks/<uuid:task_id>/outputs/<path:name>",
        apis.agent_output_upload,
        name="agent-output-upload",
    ),
    path("agents/v1/tasks/<uuid:task_id>/reports/", apis.agent_reports_post, name="agent-reports"),
    path("agents/v1/cloud/instances/", apis.agent_instances, name="agent-cloud-instances"),
    path(
        "agents/v1/cloud/instances/<str:name>/token/",
        apis.agent_instance_token,
        name="agent-cloud-instance-token",
    ),
    path("agents/v1/cloud/handoff/", apis.agent_handoff, name="agent-cloud-handoff"),
]
