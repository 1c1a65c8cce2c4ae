"""The catalogue's API: entries, and the apps people launch from them."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import ApiToken, Role
from apps.catalogue import addresses, selectors, services, shipped
from apps.catalogue.models import AppInstance, CatalogueEntry
from apps.core.errors import InvalidInput


def _entry(
    template: dict[str, Any], *, shipped_with: bool, allowed: bool, added_by: str = ""
) -> dict[str, Any]:
    return {**template, "shipped": shipped_with, "allowed_for_projects": allowed, "added_by": added_by}


class CatalogueView(TenantAPIView):
    @extend_schema(
        summary="The catalogue: the entries shipped with Klique and the tenant's own, every version"
    )
    def get(self, request: Request) -> Response:
        entries = [_entry(t.as_json(), shipped_with=True, allowed=True) for t in shipped.TEMPLATES.values()]
        entries += [
            _entry(
                row.template, shipped_with=False, allowed=row.allowed_for_projects, added_by=row.created_by
            )
            for row in CatalogueEntry.objects.all()
        ]
        return Response({"results": entries})

    @extend_schema(summary="Add an entry (a version of an app) from a template document")
    def post(self, request: Request) -> Response:
        data = request.data
        if not isinstance(data, dict):
            raise InvalidInput("Send a template document: a JSON object.")
        document = data.get("template", data)
        allowed = data.get("allowed_for_projects", True) if "template" in data else True
        if not isinstance(allowed, bool):
            raise InvalidInput("allowed_for_projects is true or false.", field="allowed_for_projects")
        row = services.entry_add(user=self.user, document=document, allowed_for_projects=allowed)
        body = _entry(
            row.template, shipped_with=False, allowed=row.allowed_for_projects, added_by=row.created_by
        )
        return Response(body, status=status.HTTP_201_CREATED)


class LaunchIn(serializers.Serializer[AppInstance]):
    entry = serializers.CharField(max_length=63)
    version = serializers.CharField(max_length=40, required=False, allow_null=True, default=None)
    name = serializers.CharField(max_length=100, required=False, default="", allow_blank=True)
    variables = serializers.DictField(required=False, default=dict)
    compute_resource = serializers.CharField(max_length=200, required=False, allow_null=True, default=None)
    gpus = serializers.CharField(max_length=12, required=False, allow_null=True, default=None)
    project = serializers.CharField(max_length=100, required=False, allow_null=True, default=None)
    share_with_project = serializers.BooleanField(required=False, default=False)
    groups = serializers.ListField(
        child=serializers.CharField(max_length=100), required=False, default=list, max_length=50
    )
    secrets = serializers.ListField(
        child=serializers.CharField(max_length=128),
        required=False,
        default=list,
        max_length=50,
        help_text="vault secrets to give the app as environment variables, beside its entry's own",
    )
    worker_compute_resource = serializers.CharField(
        max_length=200,
        required=False,
        allow_null=True,
        default=None,
        help_text="a Slurm cluster's: where its worker nodes run (else the entry's choice, or the app's own)",
    )


class AppOut(serializers.ModelSerializer[AppInstance]):
    entry = serializers.CharField(source="entry_name")
    version = serializers.CharField(source="entry_version")
    owner = serializers.CharField(source="owner.username")
    project = serializers.CharField(source="project.name", allow_null=True, default=None)
    compute_resource = serializers.CharField(source="compute_resource_name")
    task_id = serializers.UUIDField(allow_null=True)
    state = serializers.SerializerMethodField()
    detail = serializers.SerializerMethodField()
    address = serializers.SerializerMethodField()
    url = serializers.SerializerMethodField()
    groups = serializers.SerializerMethodField()
    model = serializers.SerializerMethodField(
        help_text="the model the app serves through the tenant's gateway (a model endpoint), or null"
    )

    class Meta:
        model = AppInstance
        fields = [
            "id", "name", "entry", "version", "owner", "project", "shared_with_project", "groups",
            "compute_resource", "gpus", "variables", "secrets", "task_id", "state", "detail", "address",
            "url", "model", "ready_at", "last_request_at", "created_at",
        ]  # fmt: skip

    def _state(self, app: AppInstance) -> selectors.AppState:
        """The app's state, worked out once for its two fields."""
        known: dict[object, selectors.AppState] = self.__dict__.setdefault("_states", {})
        if app.pk not in known:
            known[app.pk] = selectors.app_state(app)
        return known[app.pk]

    def get_state(self, app: AppInstance) -> str:
        return self._state(app).state

    def get_detail(self, app: AppInstance) -> str:
        return self._state(app).detail

    def get_model(self, app: AppInstance) -> str | None:
        return selectors.served_model(app)

    def _origin(self, host: str) -> str:
        request = self.context.get("request")
        scheme = request.scheme if request is not None else "https"
        return f"{scheme}://{host}"

    def get_address(self, app: AppInstance) -> str:
        request = self.context.get("request")
        return f"{self._origin(request.get_host() if request else '')}/apps/{app.pk}/"

    def get_url(self, app: AppInstance) -> str:
        request = self.context.get("request")
        return self._origin(addresses.app_host(app.slug, request.get_host() if request else "")) + "/"

    def get_groups(self, app: AppInstance) -> list[str]:
        return sorted(group.name for group in app.groups.all())


class AppListView(TenantAPIView):
    write_role = Role.MEMBER
    submit_scope = True

    @extend_schema(responses=AppOut(many=True), summary="Apps you may see: yours and those shared with you")
    def get(self, request: Request) -> Response:
        return self.page(selectors.apps_visible_to(self.user), AppOut, context={"request": request})

    @extend_schema(request=LaunchIn, responses={201: AppOut}, summary="Launch an app from the catalogue")
    def post(self, request: Request) -> Response:
        data = LaunchIn(data=request.data)
        data.is_valid(raise_exception=True)
        token = request.auth if isinstance(request.auth, ApiToken) else None
        app = services.app_launch(tenant=self.tenant, user=self.user, token=token, **data.validated_data)
        return Response(AppOut(app, context={"request": request}).data, status=status.HTTP_201_CREATED)


class AppDetailView(TenantAPIView):
    @extend_schema(responses=AppOut)
    def get(self, request: Request, app_id: str) -> Response:
        app = get_object_or_404(selectors.apps_visible_to(self.user), pk=app_id)
        return Response(AppOut(app, context={"request": request}).data)


class AppStopView(TenantAPIView):
    write_role = Role.MEMBER
    submit_scope = True

    @extend_schema(request=None, responses=AppOut, summary="Stop an app (its files stay)")
    def post(self, request: Request, app_id: str) -> Response:
        app = get_object_or_404(selectors.apps_visible_to(self.user), pk=app_id)
        app = services.app_stop(tenant=self.tenant, user=self.user, app=app)
        return Response(AppOut(app, context={"request": request}).data)


class AppStartView(TenantAPIView):
    write_role = Role.MEMBER
    submit_scope = True

    @extend_schema(request=None, responses=AppOut, summary="Start a stopped app again")
    def post(self, request: Request, app_id: str) -> Response:
        app = get_object_or_404(selectors.apps_visible_to(self.user), pk=app_id)
        token = request.auth if isinstance(request.auth, ApiToken) else None
        app = services.app_start(tenant=self.tenant, user=self.user, app=app, token=token)
        return Response(AppOut(app, context={"request": request}).data)
