from __future__ import annotations

from django.urls import path

from apps.portal import views

urlpatterns = [
    path("portal/sign-in/", views.sign_in, name="portal-sign-in"),
    path("portal/sign-out/", views.sign_out, name="portal-sign-out"),
    path("portal/", views.tasks, name="portal-tasks"),
    path("portal/tasks/table/", views.tasks_table, name="portal-tasks-table"),
    path("portal/tasks/submit/", views.task_submit, name="portal-task-submit"),
    path("portal/tasks/<uuid:task_id>/", views.task, name="portal-task"),
    path("portal/dashboard/", views.dashboard, name="portal-dashboard"),
    path("portal/configuration/", views.configuration, name="portal-configuration"),
    path(
        "portal/configuration/validate/", views.configuration_validate, name="portal-configuration-validate"
    ),
    path(
        "portal/configuration/provision/",
        views.configuration_provision,
        name="portal-configuration-provision",
    ),
]
