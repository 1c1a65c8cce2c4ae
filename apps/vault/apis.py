"""Secrets: write-only. Names and where they live can be listed; values are never returned."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import Group, Project, Role
from apps.core.ids import as_uuid
from apps.vault import selectors, services
from apps.vault.models import Secret


class AudienceOut(serializers.Serializer[Secret]):
    groups = serializers.SerializerMethodField()
    projects = serializers.SerializerMethodField()

    def get_groups(self, secret: Secret) -> list[str]:
        return sorted(group.name for group in secret.audience_groups.all())

    def get_projects(self, secret: Secret) -> list[str]:
        return sorted(project.name for project in secret.audience_projects.all())


class SecretOut(serializers.ModelSerializer[Secret]):
    project = serializers.CharField(source="project.name", allow_null=True, default=None)
    owner = serializers.CharField(source="owner.username", allow_null=True, default=None)
    created_by = serializers.CharField(source="created_by.username", allow_null=True, default=None)
    audience = AudienceOut(source="*", read_only=True)

    class Meta:
        model = Secret
        fields = [
            "id", "scope", "project", "owner", "name", "audience", "created_by", "created_at", "updated_at",
        ]  # fmt: skip


class AudienceIn(serializers.Serializer[Secret]):
    groups = serializers.ListField(
        child=serializers.CharField(max_length=100), required=False, default=list, max_length=200
    )
    projects = serializers.ListField(
        child=serializers.CharField(max_length=100), required=False, default=list, max_length=200
    )


AUDIENCE_HELP = (
    "tenant secrets only: the groups whose members' tasks and the projects whose tasks may be given it "
    "(names or ids); without one, no task may"
)


class SecretIn(serializers.Serializer[Secret]):
    scope = serializers.ChoiceField(choices=Secret.Scope.choices, default=Secret.Scope.USER)
    project = serializers.CharField(required=False, help_text="the project's name or id, for scope project")
    name = serializers.CharField(max_length=128)
    value = serializers.CharField(max_length=70_000, trim_whitespace=False, write_only=True)
    audience = AudienceIn(required=False, help_text=AUDIENCE_HELP)


class SecretValueIn(serializers.Serializer[Secret]):
    value = serializers.CharField(max_length=70_000, trim_whitespace=False, write_only=True, required=False)
    audience = AudienceIn(required=False, help_text=AUDIENCE_HELP)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "value" not in attrs and "audience" not in attrs:
            raise serializers.ValidationError("Send a new value, a new audience, or both.")
        return attrs


def _audience(data: dict[str, Any] | None) -> services.Audience | None:
    """Groups and projects by name or id; an unknown one is a 400 naming it."""
    if data is None:
        return None
    return services.Audience(
        groups=tuple(_named(Group, reference, "audience.groups") for reference in data["groups"]),
        projects=tuple(_named(Project, reference, "audience.projects") for reference in data["projects"]),
    )


def _named(model: type[Group] | type[Project], reference: str, field: str) -> Any:
    identifier = as_uuid(reference)
    found = (
        model.objects.filter(pk=identifier) if identifier else model.objects.filter(name=reference)
    ).first()
    if found is None:
        raise serializers.ValidationError({field: [f"No {model.__name__.lower()} {reference!r} here."]})
    return found


def _project(reference: str | None) -> Project | None:
    if not reference:
        return None
    identifier = as_uuid(reference)
    by_id = Project.objects.filter(pk=identifier).first() if identifier else None
    return by_id or get_object_or_404(Project, name=reference)


class SecretListView(TenantAPIView):
    write_role = Role.MEMBER

    @extend_schema(responses=SecretOut(many=True), summary="Secrets you can see: names only, never values")
    def get(self, request: Request) -> Response:
        return self.page(selectors.secrets_visible_to(self.user), SecretOut)

    @extend_schema(
        request=SecretIn,
        responses={201: SecretOut},
        summary="Keep a secret (tenant: admins; project: its admins; user: your own), or replace its value",
    )
    def post(self, request: Request) -> Response:
        data = SecretIn(data=request.data)
        data.is_valid(raise_exception=True)
        scope = data.validated_data["scope"]
        project = _project(data.validated_data.get("project"))
        if scope == Secret.Scope.PROJECT and project is None:
            raise serializers.ValidationError({"project": ["A project secret names its project."]})
        secret = services.secret_set(
            user=self.user,
            scope=scope,
            name=data.validated_data["name"],
            value=data.validated_data["value"],
            project=project,
            audience=_audience(data.validated_data.get("audience")),
        )
        return Response(SecretOut(secret).data, status=status.HTTP_201_CREATED)


class SecretDetailView(TenantAPIView):
    write_role = Role.MEMBER

    @extend_schema(responses=SecretOut, summary="A secret's name and where it lives; never its value")
    def get(self, request: Request, secret_id: str) -> Response:
        return Response(
            SecretOut(get_object_or_404(selectors.secrets_visible_to(self.user), pk=secret_id)).data
        )

    @extend_schema(
        request=SecretValueIn, responses=SecretOut, summary="Replace a secret's value, its audience, or both"
    )
    def put(self, request: Request, secret_id: str) -> Response:
        secret = get_object_or_404(selectors.secrets_visible_to(self.user), pk=secret_id)
        data = SecretValueIn(data=request.data)
        data.is_valid(raise_exception=True)
        updated = services.secret_set(
            user=self.user,
            scope=secret.scope,
            name=secret.name,
            value=data.validated_data.get("value"),
            project=secret.project,
            audience=_audience(data.validated_data.get("audience")),
        )
        return Response(SecretOut(updated).data)

    @extend_schema(responses={204: None}, summary="Delete a secret")
    def delete(self, request: Request, secret_id: str) -> Response:
        secret = get_object_or_404(selectors.secrets_visible_to(self.user), pk=secret_id)
        services.secret_delete(user=self.user, secret=secret)
        return Response(status=status.HTTP_204_NO_CONTENT)
