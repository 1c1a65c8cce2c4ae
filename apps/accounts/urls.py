from __future__ import annotations

from django.urls import path

from apps.accounts import apis

# Served on tenant domains and on the provider's own domain alike.
identity_urlpatterns = [
    path("me/", apis.MeView.as_view(), name="me"),
    path("tokens/", apis.TokenListView.as_view(), name="token-list"),
    path("tokens/<uuid:token_id>/", apis.TokenDetailView.as_view(), name="token-detail"),
]

urlpatterns = [
    *identity_urlpatterns,
    path("users/", apis.UserListView.as_view(), name="user-list"),
    path("users/<uuid:user_id>/", apis.UserDetailView.as_view(), name="user-detail"),
    path("service-accounts/", apis.ServiceAccountListView.as_view(), name="service-account-list"),
    path(
        "service-accounts/<uuid:account_id>/",
        apis.ServiceAccountDetailView.as_view(),
        name="service-account-detail",
    ),
    path(
        "service-accounts/<uuid:account_id>/tokens/",
        apis.ServiceAccountTokenView.as_view(),
        name="service-account-tokens",
    ),
    path("groups/", apis.GroupListView.as_view(), name="group-list"),
    path("groups/<uuid:group_id>/", apis.GroupDetailView.as_view(), name="group-detail"),
    path("projects/", apis.ProjectListView.as_view(), name="project-list"),
    path("projects/<uuid:project_id>/", apis.ProjectDetailView.as_view(), name="project-detail"),
    path("projects/<uuid:project_id>/members/", apis.ProjectMemberListView.as_view(), name="project-members"),
    path(
        "projects/<uuid:project_id>/members/<uuid:user_id>/",
        apis.ProjectMemberDetailView.as_view(),
        name="project-member-detail",
    ),
    path("audit/", apis.AuditListView.as_view(), name="audit-list"),
]
