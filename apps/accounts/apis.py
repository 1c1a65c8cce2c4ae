"""The accounts API: thin views that check input, call one service or selector, and shape the output."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts import selectors, serializers, services
from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import ApiToken, Group, Project, Role, User
from apps.accounts.permissions import is_project_admin
from apps.audit.models import AuditEvent


class MeView(TenantAPIView):
    @extend_schema(responses=serializers.UserOut, summary="The signed-in user")
    def get(self, request: Request) -> Response:
        return Response(serializers.UserOut(self.user).data)


class UserListView(TenantAPIView):
    @extend_schema(responses=serializers.UserOut(many=True), summary="People in this tenant")
    def get(self, request: Request) -> Response:
        return self.page(selectors.person_list(), serializers.UserOut)

    @extend_schema(request=serializers.UserIn, responses={201: serializers.UserOut}, summary="Add a person")
    def post(self, request: Request) -> Response:
        data = serializers.UserIn(data=request.data)
        data.is_valid(raise_exception=True)
        user = services.user_create(tenant=self.tenant, **data.validated_data)
        return Response(serializers.UserOut(user).data, status=status.HTTP_201_CREATED)


class UserDetailView(TenantAPIView):
    @extend_schema(responses=serializers.UserOut)
    def get(self, request: Request, user_id: str) -> Response:
        return Response(serializers.UserOut(get_object_or_404(selectors.person_list(), pk=user_id)).data)

    @extend_schema(
        request=serializers.UserPatch, responses=serializers.UserOut, summary="Change role, email or status"
    )
    def patch(self, request: Request, user_id: str) -> Response:
        user = get_object_or_404(selectors.person_list(), pk=user_id)
        data = serializers.UserPatch(data=request.data)
        data.is_valid(raise_exception=True)
        user = services.user_update(tenant=self.tenant, user=user, **data.validated_data)
        return Response(serializers.UserOut(user).data)


class ServiceAccountListView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses=serializers.ServiceAccountOut(many=True), summary="Service accounts")
    def get(self, request: Request) -> Response:
        return self.page(selectors.service_account_list(), serializers.ServiceAccountOut)

    @extend_schema(request=serializers.ServiceAccountIn, responses={201: serializers.ServiceAccountOut})
    def post(self, request: Request) -> Response:
        data = serializers.ServiceAccountIn(data=request.data)
        data.is_valid(raise_exception=True)
        account = services.service_account_create(tenant=self.tenant, **data.validated_data)
        return Response(serializers.ServiceAccountOut(account).data, status=status.HTTP_201_CREATED)


class ServiceAccountDetailView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses=serializers.ServiceAccountOut)
    def get(self, request: Request, account_id: str) -> Response:
        account = get_object_or_404(selectors.service_account_list(), pk=account_id)
        return Response(serializers.ServiceAccountOut(account).data)

    @extend_schema(request=serializers.ServiceAccountPatch, responses=serializers.ServiceAccountOut)
    def patch(self, request: Request, account_id: str) -> Response:
        account = get_object_or_404(selectors.service_account_list(), pk=account_id)
        data = serializers.ServiceAccountPatch(data=request.data)
        data.is_valid(raise_exception=True)
        account = services.user_update(tenant=self.tenant, user=account, **data.validated_data)
        return Response(serializers.ServiceAccountOut(account).data)


class ServiceAccountTokenView(TenantAPIView):
    @extend_schema(
        request=serializers.TokenIn,
        responses={201: serializers.TokenCreated},
        summary="Issue a token to a service account (shown once)",
    )
    def post(self, request: Request, account_id: str) -> Response:
        account = get_object_or_404(selectors.service_account_list(), pk=account_id)
        return _issue_token(request, tenant=self.tenant, user=account)


def _issue_token(request: Request, *, tenant: Any, user: User) -> Response:
    data = serializers.TokenIn(data=request.data)
    data.is_valid(raise_exception=True)
    fields = dict(data.validated_data)
    if "gpu_quota" in fields:
        fields["gpu_quota_units"] = fields.pop("gpu_quota")
    issued = services.token_create(tenant=tenant, user=user, **fields)
    body = {**serializers.TokenOut(issued.token).data, "token": issued.secret}
    return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})


class TokenListView(TenantAPIView):
    write_role = Role.VIEWER  # anyone may hold tokens of their own

    @extend_schema(
        responses=serializers.TokenOut(many=True), summary="Your tokens (all of them, for an admin)"
    )
    def get(self, request: Request) -> Response:
        return self.page(selectors.tokens_visible_to(self.user), serializers.TokenOut)

    @extend_schema(
        request=serializers.TokenIn,
        responses={201: serializers.TokenCreated},
        summary="Create a token for yourself (shown once)",
    )
    def post(self, request: Request) -> Response:
        return _issue_token(request, tenant=self.tenant, user=self.user)


class TokenDetailView(TenantAPIView):
    write_role = Role.VIEWER

    @extend_schema(responses=serializers.TokenOut)
    def get(self, request: Request, token_id: str) -> Response:
        token = get_object_or_404(selectors.tokens_visible_to(self.user), pk=token_id)
        return Response(serializers.TokenOut(token).data)

    @extend_schema(responses={204: None}, summary="Revoke a token at once")
    def delete(self, request: Request, token_id: str) -> Response:
        token: ApiToken = get_object_or_404(selectors.tokens_visible_to(self.user), pk=token_id)
        services.token_revoke(token=token)
        return Response(status=status.HTTP_204_NO_CONTENT)


class GroupListView(TenantAPIView):
    @extend_schema(responses=serializers.GroupOut(many=True))
    def get(self, request: Request) -> Response:
        return self.page(selectors.group_list(), serializers.GroupOut)

    @extend_schema(request=serializers.GroupIn, responses={201: serializers.GroupOut})
    def post(self, request: Request) -> Response:
        data = serializers.GroupIn(data=request.data)
        data.is_valid(raise_exception=True)
        group = services.group_save(tenant=self.tenant, **data.validated_data)
        return Response(serializers.GroupOut(group).data, status=status.HTTP_201_CREATED)


class GroupDetailView(TenantAPIView):
    @extend_schema(responses=serializers.GroupOut)
    def get(self, request: Request, group_id: str) -> Response:
        return Response(serializers.GroupOut(get_object_or_404(selectors.group_list(), pk=group_id)).data)

    @extend_schema(request=serializers.GroupIn, responses=serializers.GroupOut)
    def patch(self, request: Request, group_id: str) -> Response:
        group: Group = get_object_or_404(selectors.group_list(), pk=group_id)
        data = serializers.GroupIn(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        group = services.group_save(tenant=self.tenant, group=group, **data.validated_data)
        return Response(serializers.GroupOut(group).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, group_id: str) -> Response:
        services.group_delete(
            tenant=self.tenant, group=get_object_or_404(selectors.group_list(), pk=group_id)
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


class ProjectListView(TenantAPIView):
    @extend_schema(responses=serializers.ProjectOut(many=True))
    def get(self, request: Request) -> Response:
        return self.page(selectors.project_list(), serializers.ProjectOut)

    @extend_schema(
        request=serializers.ProjectIn,
        responses={201: serializers.ProjectOut},
        summary="Create a project; its creator becomes its first project admin",
    )
    def post(self, request: Request) -> Response:
        data = serializers.ProjectIn(data=request.data)
        data.is_valid(raise_exception=True)
        project = services.project_save(tenant=self.tenant, admin=self.user, **data.validated_data)
        return Response(serializers.ProjectOut(project).data, status=status.HTTP_201_CREATED)


class ProjectScopedView(TenantAPIView):
    """Writes need a project admin of this project (or a tenant admin); the role check is per object."""

    write_role = Role.VIEWER

    def project_for_write(self, project_id: str) -> Project:
        project = get_object_or_404(selectors.project_list(), pk=project_id)
        if not is_project_admin(self.user, project):
            raise PermissionDenied(
                f"Only an admin of project {project.name} or a tenant admin may change it. "
                "Ask one of them to make you a project admin."
            )
        return project


class ProjectDetailView(ProjectScopedView):
    @extend_schema(responses=serializers.ProjectOut)
    def get(self, request: Request, project_id: str) -> Response:
        return Response(
            serializers.ProjectOut(get_object_or_404(selectors.project_list(), pk=project_id)).data
        )

    @extend_schema(request=serializers.ProjectIn, responses=serializers.ProjectOut)
    def patch(self, request: Request, project_id: str) -> Response:
        project = self.project_for_write(project_id)
        data = serializers.ProjectIn(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        project = services.project_save(tenant=self.tenant, project=project, **data.validated_data)
        return Response(serializers.ProjectOut(project).data)

    @extend_schema(responses={204: None}, summary="Delete a project (tenant admins only)")
    def delete(self, request: Request, project_id: str) -> Response:
        project = get_object_or_404(selectors.project_list(), pk=project_id)
        if not self.user.has_role(Role.ADMIN):
            raise PermissionDenied("Only a tenant admin may delete a project.")
        project.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class ProjectMemberListView(ProjectScopedView):
    @extend_schema(responses=serializers.MembershipOut(many=True))
    def get(self, request: Request, project_id: str) -> Response:
        project = get_object_or_404(selectors.project_list(), pk=project_id)
        return self.page(selectors.project_members(project), serializers.MembershipOut)

    @extend_schema(
        request=serializers.MembershipIn,
        responses={200: serializers.MembershipOut},
        summary="Add a member or change their role",
    )
    def post(self, request: Request, project_id: str) -> Response:
        project = self.project_for_write(project_id)
        data = serializers.MembershipIn(data=request.data)
        data.is_valid(raise_exception=True)
        membership = services.project_member_set(tenant=self.tenant, project=project, **data.validated_data)
        return Response(serializers.MembershipOut(membership).data)


class ProjectMemberDetailView(ProjectScopedView):
    @extend_schema(responses={204: None})
    def delete(self, request: Request, project_id: str, user_id: str) -> Response:
        project = self.project_for_write(project_id)
        membership = get_object_or_404(selectors.project_members(project), user_id=user_id)
        services.project_member_remove(tenant=self.tenant, membership=membership)
        return Response(status=status.HTTP_204_NO_CONTENT)


# The audit log (apps.audit records it), for tenant admins.


class AuditListView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(
        responses=serializers.AuditEventOut(many=True),
        parameters=[
            OpenApiParameter(
                "action", str, description='e.g. "secret.read"; a prefix such as "secret." works'
            ),
            OpenApiParameter("actor", str),
        ],
        summary="Administrative actions and secret reads, newest first",
    )
    def get(self, request: Request) -> Response:
        events = AuditEvent.objects.all()
        if action := request.query_params.get("action"):
            events = events.filter(action__startswith=action)
        if actor := request.query_params.get("actor"):
            events = events.filter(actor=actor)
        return self.page(events, serializers.AuditEventOut)
