from __future__ import annotations

from django.urls import path

from apps.portal import catalogue, configuration, pages, views

urlpatterns = [
    path("portal/sign-in/", views.sign_in, name="portal-sign-in"),
    path("portal/sign-out/", views.sign_out, name="portal-sign-out"),
    path("portal/", views.tasks, name="portal-tasks"),
    path("portal/tasks/table/", views.tasks_table, name="portal-tasks-table"),
    path("portal/tasks/submit/", views.task_submit, name="portal-task-submit"),
    path("portal/tasks/<uuid:task_id>/", views.task, name="portal-task"),
    path("portal/tasks/<uuid:task_id>/facts/", views.task_facts, name="portal-task-facts"),
    path("portal/tasks/<uuid:task_id>/cancel/", views.task_cancel, name="portal-task-cancel"),
    path("portal/dashboard/", views.dashboard, name="portal-dashboard"),
    path("portal/dashboard/live/", views.dashboard_live, name="portal-dashboard-live"),
    path("portal/dashboard/objectives/", views.dashboard_objectives, name="portal-dashboard-objectives"),
    path("portal/queues/", pages.queues, name="portal-queues"),
    path("portal/queues/table/", pages.queues_table, name="portal-queues-table"),
    path("portal/tokens/", pages.tokens, name="portal-tokens"),
    path("portal/tokens/create/", pages.token_create, name="portal-token-create"),
    path("portal/tokens/<uuid:token_id>/revoke/", pages.token_revoke, name="portal-token-revoke"),
    path("portal/agents/", pages.agents, name="portal-agents"),
    path("portal/agents/<uuid:token_id>/revoke/", pages.agent_revoke, name="portal-agent-revoke"),
    path("portal/service-accounts/", pages.service_accounts, name="portal-service-accounts"),
    path(
        "portal/service-accounts/create/", pages.service_account_create, name="portal-service-account-create"
    ),
    path("portal/secrets/", pages.secrets, name="portal-secrets"),
    path("portal/secrets/keep/", pages.secret_keep, name="portal-secret-keep"),
    path("portal/usage/", pages.usage, name="portal-usage"),
    path("portal/apps/", catalogue.apps_page, name="portal-apps"),
    path("portal/apps/table/", catalogue.apps_table, name="portal-apps-table"),
    path("portal/apps/launch/", catalogue.app_launch, name="portal-app-launch"),
    path(
        "portal/apps/<uuid:app_id>/<str:action>/",
        catalogue.app_stop_or_start,
        name="portal-app-action",
    ),
    path("portal/configuration/", configuration.configuration, name="portal-configuration"),
    path("portal/configuration/validate/", configuration.validate, name="portal-configuration-validate"),
    path("portal/configuration/provision/", configuration.provision, name="portal-configuration-provision"),
    path("portal/configuration/what-if/", configuration.what_if, name="portal-configuration-what-if"),
    path("portal/configuration/<slug:section>/", configuration.item_save, name="portal-configuration-item"),
    path(
        "portal/configuration/<slug:section>/remove/",
        configuration.item_remove,
        name="portal-configuration-item-remove",
    ),
]
