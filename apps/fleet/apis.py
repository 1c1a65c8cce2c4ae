"""Agent tokens (tenant admins) and task logs (anyone in the tenant)."""

from __future__ import annotations

from django.core.files.storage import default_storage
from django.http import FileResponse, HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.apis import TenantAPIView
from apps.accounts.models import Role
from apps.fleet import services
from apps.fleet.models import AgentToken, TaskOutput
from apps.resources.models import Pool
from apps.scheduling.selectors import tasks_visible_to


class AgentTokenOut(serializers.ModelSerializer[AgentToken]):
    pool = serializers.CharField(source="pool.name")
    prefix = serializers.SerializerMethodField()

    class Meta:
        model = AgentToken
        fields = ["id", "name", "pool", "prefix", "created_at", "revoked_at", "last_used_at"]

    def get_prefix(self, token: AgentToken) -> str:
        return f"kqa_{token.prefix}"


class AgentTokenIn(serializers.Serializer[AgentToken]):
    name = serializers.CharField(max_length=100)


class PoolAgentTokensView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses=AgentTokenOut(many=True), summary="The pool's agent tokens")
    def get(self, request: Request, pool_id: str) -> Response:
        pool = get_object_or_404(Pool, pk=pool_id)
        return self.page(AgentToken.objects.filter(pool=pool).select_related("pool"), AgentTokenOut)

    @extend_schema(
        request=AgentTokenIn, responses={201: AgentTokenOut}, summary="Issue an agent token (shown once)"
    )
    def post(self, request: Request, pool_id: str) -> Response:
        pool = get_object_or_404(Pool, pk=pool_id)
        data = AgentTokenIn(data=request.data)
        data.is_valid(raise_exception=True)
        issued = services.agent_token_create(pool=pool, name=data.validated_data["name"])
        body = {**AgentTokenOut(issued.token).data, "token": issued.secret}
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})


class AgentTokenDetailView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses={204: None}, summary="Revoke an agent token; its agent is refused from then on")
    def delete(self, request: Request, token_id: str) -> Response:
        services.agent_token_revoke(tenant=self.tenant, token=get_object_or_404(AgentToken, pk=token_id))
        return Response(status=status.HTTP_204_NO_CONTENT)


class TaskLogsView(TenantAPIView):
    @extend_schema(summary="The task's output, in order; ?after=SEQ for what came since")
    def get(self, request: Request, task_id: str) -> Response:
        task = get_object_or_404(tasks_visible_to(self.user), pk=task_id)
        try:
            after = int(request.query_params.get("after", 0))
        except ValueError:
            raise serializers.ValidationError({"after": ["A sequence number."]}) from None
        return Response(services.task_logs(task, after=after))


class TaskOutputOut(serializers.ModelSerializer[TaskOutput]):
    class Meta:
        model = TaskOutput
        fields = ["name", "size", "sha256", "at"]


class TaskOutputListView(TenantAPIView):
    @extend_schema(responses=TaskOutputOut(many=True), summary="The files the task left as outputs")
    def get(self, request: Request, task_id: str) -> Response:
        task = get_object_or_404(tasks_visible_to(self.user), pk=task_id)
        return Response(TaskOutputOut(task.outputs.all(), many=True).data)


class TaskOutputDownloadView(TenantAPIView):
    @extend_schema(responses={(200, "application/octet-stream"): bytes}, summary="Download one output")
    def get(self, request: Request, task_id: str, name: str) -> FileResponse:
        task = get_object_or_404(tasks_visible_to(self.user), pk=task_id)
        output = get_object_or_404(task.outputs, name=name)
        return FileResponse(
            default_storage.open(output.stored, "rb"), as_attachment=True, filename=output.name
        )


@csrf_exempt
def agent_output_upload(request: HttpRequest, task_id: str, name: str) -> JsonResponse:
    """PUT /agents/v1/tasks/{id}/outputs/{name}: an agent uploads a task's output, with its agent token.
    Outside the user API on purpose: agent tokens open nothing else."""
    if request.method != "PUT":
        return JsonResponse({"detail": "Upload an output with PUT."}, status=405)
    tenant = getattr(request, "tenant", None)
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if tenant is None or scheme.lower() != "bearer":
        return JsonResponse({"detail": "Send 'Authorization: Bearer <agent token>'."}, status=401)
    try:
        token = services.agent_authenticate(presented=presented.strip())
        output = services.output_store(
            tenant=tenant, pool=token.pool, task_id=str(task_id), name=name, content=request
        )
    except services.AgentRejected as rejected:
        return JsonResponse({"detail": str(rejected)}, status=400 if "output" in str(rejected) else 403)
    return JsonResponse(TaskOutputOut(output).data, status=201)
