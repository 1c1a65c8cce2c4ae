"""The scheduling API: tasks, their history and why they wait."""

from __future__ import annotations

from django.urls import path

from apps.scheduling import apis

urlpatterns = [
    path("queue-wait/", apis.QueueWaitView.as_view(), name="queue-wait"),
    path("wait-objectives/", apis.WaitObjectiveListView.as_view(), name="wait-objectives"),
    path(
        "wait-objectives/<uuid:objective_id>/", apis.WaitObjectiveDetailView.as_view(), name="wait-objective"
    ),
    path("webhooks/", apis.WebhookListView.as_view(), name="webhooks"),
    path("webhooks/<uuid:webhook_id>/", apis.WebhookDetailView.as_view(), name="webhook"),
    path(
        "webhooks/<uuid:webhook_id>/deliveries/",
        apis.WebhookDeliveriesView.as_view(),
        name="webhook-deliveries",
    ),
    path("tasks/", apis.TaskListView.as_view(), name="task-list"),
    path("tasks/<uuid:task_id>/", apis.TaskDetailView.as_view(), name="task-detail"),
    path("tasks/<uuid:task_id>/cancel/", apis.TaskCancelView.as_view(), name="task-cancel"),
    path("tasks/<uuid:task_id>/why/", apis.TaskWhyView.as_view(), name="task-why"),
    path("tasks/<uuid:task_id>/history/", apis.TaskHistoryView.as_view(), name="task-history"),
]
