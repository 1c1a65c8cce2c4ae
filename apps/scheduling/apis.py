"""The tasks API: submit (one or many), list and filter, read, cancel, why it waits, its history."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import ApiToken, Role
from apps.scheduling import objectives, selectors, services, webhooks
from apps.scheduling.engine import SizeError, to_gpus_text, units
from apps.scheduling.models import EventWebhook, Task, TaskEvent, TaskState, WaitObjective, WebhookDelivery


class TaskIn(serializers.Serializer[Task]):
    compute_resource = serializers.CharField(max_length=200, help_text="name or id")
    gpus = serializers.CharField(max_length=20, required=False, allow_null=True, default=None)
    name = serializers.CharField(max_length=200, required=False, default="", allow_blank=True)
    project = serializers.CharField(max_length=100, required=False, allow_null=True, default=None)
    priority = serializers.IntegerField(required=False, default=0, min_value=-100, max_value=100)
    max_attempts = serializers.IntegerField(required=False, default=3, min_value=1, max_value=20)
    time_limit_seconds = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=None,
        help_text="how long a run may last; past it the run is stopped with a grace period. Lets the "
        "scheduler run it in gaps before a waiting larger task (backfill). Default: the profile's.",
    )
    spec = serializers.DictField(required=False, default=dict)
    idempotency_key = serializers.CharField(
        max_length=100,
        required=False,
        default="",
        allow_blank=True,
        help_text="your own key for this submission: sent again, it returns the task it made, not a second",
    )

    def validate_gpus(self, value: Any) -> str | None:
        return None if value is None else str(value)


class TaskOut(serializers.ModelSerializer[Task]):
    compute_resource = serializers.CharField(source="compute_resource_name")
    compute_resource_id = serializers.UUIDField(allow_null=True)
    submitter = serializers.CharField(source="submitter.username")
    project = serializers.CharField(source="project.name", allow_null=True, default=None)
    pool = serializers.CharField(source="pool.name", allow_null=True, default=None)
    gpus = serializers.SerializerMethodField()

    class Meta:
        model = Task
        fields = [
            "id",
            "name",
            "compute_resource",
            "compute_resource_id",
            "submitter",
            "submitted_by_agent",
            "project",
            "gpus",
            "nodes",
            "sharing",
            "priority",
            "state",
            "reason_code",
            "reason",
            "pool",
            "attempts",
            "max_attempts",
            "time_limit_seconds",
            "exit_code",
            "submitted_at",
            "queued_at",
            "placed_at",
            "started_at",
            "ended_at",
            "spec",
        ]

    def get_gpus(self, task: Task) -> str:
        return to_gpus_text(task.size_units)


class EventOut(serializers.ModelSerializer[TaskEvent]):
    class Meta:
        model = TaskEvent
        fields = ["at", "actor", "from_state", "to_state", "message"]


class WhyOut(serializers.Serializer[object]):
    state = serializers.CharField()
    reason_code = serializers.CharField()
    reason = serializers.CharField()
    position = serializers.IntegerField(allow_null=True)
    queued_ahead = serializers.IntegerField()
    waiting_seconds = serializers.FloatField(allow_null=True)


def _request(data: dict[str, Any]) -> services.TaskRequest:
    return services.TaskRequest(**data)


class TaskListView(TenantAPIView):
    write_role = Role.MEMBER
    submit_scope = True

    @extend_schema(
        parameters=[
            OpenApiParameter("state", str),
            OpenApiParameter("compute_resource", str),
            OpenApiParameter("mine", bool),
            OpenApiParameter("project", str),
            OpenApiParameter("id_prefix", str),
        ],
        responses=TaskOut(many=True),
        summary="Tasks, newest first",
    )
    def get(self, request: Request) -> Response:
        tasks = selectors.tasks_visible_to(self.user)
        query = request.query_params
        if state := query.get("state"):
            if state not in TaskState.values:
                raise serializers.ValidationError(
                    {"state": [f"Unknown state; use one of {', '.join(TaskState.values)}."]}
                )
            tasks = tasks.filter(state=state)
        if resource := query.get("compute_resource"):
            tasks = tasks.filter(compute_resource_name=resource)
        if query.get("mine") in {"1", "true", "yes"}:
            tasks = tasks.filter(submitter=self.user)
        if project := query.get("project"):
            tasks = tasks.filter(project__name=project)
        if prefix := query.get("id_prefix"):
            if not all(character in "0123456789abcdef-" for character in prefix.lower()):
                raise serializers.ValidationError(
                    {"id_prefix": ["A task id has hexadecimal digits and dashes."]}
                )
            tasks = tasks.filter(id__startswith=prefix.lower())
        return self.page(tasks, TaskOut)

    @extend_schema(
        request=TaskIn,
        responses={201: TaskOut(many=True)},
        summary="Submit a task, or a list of tasks (all or none)",
    )
    def post(self, request: Request) -> Response:
        many = isinstance(request.data, list)
        if many and not request.data:
            raise serializers.ValidationError({"tasks": ["Send at least one task."]})
        if many and len(request.data) > 1000:
            raise serializers.ValidationError({"tasks": ["Send at most 1,000 tasks at once."]})
        data = TaskIn(data=request.data, many=many)
        data.is_valid(raise_exception=True)
        rows = data.validated_data if many else [data.validated_data]
        token = request.auth if isinstance(request.auth, ApiToken) else None
        tasks = services.tasks_submit(
            tenant=self.tenant, user=self.user, requests=[_request(row) for row in rows], token=token
        )
        body = TaskOut(tasks, many=True).data if many else TaskOut(tasks[0]).data
        return Response(body, status=status.HTTP_201_CREATED)


class TaskDetailView(TenantAPIView):
    @extend_schema(responses=TaskOut)
    def get(self, request: Request, task_id: str) -> Response:
        return Response(TaskOut(get_object_or_404(selectors.tasks_visible_to(self.user), pk=task_id)).data)


class TaskCancelView(TenantAPIView):
    write_role = Role.MEMBER
    submit_scope = True

    @extend_schema(request=None, responses=TaskOut, summary="Cancel a task that has not ended")
    def post(self, request: Request, task_id: str) -> Response:
        task = get_object_or_404(selectors.tasks_visible_to(self.user), pk=task_id)
        task = services.task_cancel(tenant=self.tenant, user=self.user, task=task)
        return Response(TaskOut(task).data)


class TaskWhyView(TenantAPIView):
    @extend_schema(responses=WhyOut, summary="Why the task waits, and its place in the queue")
    def get(self, request: Request, task_id: str) -> Response:
        task = get_object_or_404(selectors.tasks_visible_to(self.user), pk=task_id)
        return Response(WhyOut(selectors.why(task)).data)


class TaskHistoryView(TenantAPIView):
    @extend_schema(responses=EventOut(many=True), summary="Every state change: who, what, when")
    def get(self, request: Request, task_id: str) -> Response:
        task = get_object_or_404(selectors.tasks_visible_to(self.user), pk=task_id)
        return Response(EventOut(task.events.all(), many=True).data)


class QueueWaitView(TenantAPIView):
    @extend_schema(
        parameters=[OpenApiParameter("by", str, enum=["compute_resource", "group"])],
        summary="p50 and p95 queue wait over the last 24 hours",
    )
    def get(self, request: Request) -> Response:
        by = request.query_params.get("by", "compute_resource")
        if by not in {"compute_resource", "group"}:
            raise serializers.ValidationError({"by": ["Use compute_resource or group."]})
        return Response(
            {
                key: {
                    "placed": stats.placed,
                    "p50_seconds": stats.p50_seconds,
                    "p95_seconds": stats.p95_seconds,
                }
                for key, stats in selectors.queue_wait(by=by).items()
            }
        )


class WaitObjectiveIn(serializers.Serializer[WaitObjective]):
    name = serializers.SlugField(max_length=100)
    policy = serializers.CharField(max_length=100, required=False, allow_null=True, default=None)
    compute_resource = serializers.CharField(max_length=200, required=False, allow_null=True, default=None)
    percentile = serializers.FloatField(help_text="95 for p95; between 0 and 100")
    target_seconds = serializers.IntegerField(help_text="the longest wait the objective allows")
    window_seconds = serializers.IntegerField(help_text="measured over this long (at least an hour)")
    min_gpus = serializers.CharField(max_length=20, required=False, allow_null=True, default=None)
    max_gpus = serializers.CharField(max_length=20, required=False, allow_null=True, default=None)


def _objective_out(objective: WaitObjective) -> dict[str, Any]:
    return {
        "id": str(objective.pk),
        "name": objective.name,
        "policy": objective.policy.name if objective.policy else None,
        "compute_resource": objective.compute_resource.name if objective.compute_resource else None,
        "percentile": objective.percentile,
        "target_seconds": objective.target_seconds,
        "window_seconds": objective.window_seconds,
        "min_gpus": to_gpus_text(objective.min_units) if objective.min_units is not None else None,
        "max_gpus": to_gpus_text(objective.max_units) if objective.max_units is not None else None,
        "announced_state": objective.state,
        "state_since": objective.state_since,
        **objectives.status(objective).as_dict(),
    }


def _objective_fields(data: dict[str, Any]) -> dict[str, Any]:
    fields = dict(data)
    for key, unit_key in (("min_gpus", "min_units"), ("max_gpus", "max_units")):
        text = fields.pop(key)
        try:
            fields[unit_key] = None if text is None else units(text)
        except SizeError as error:
            raise serializers.ValidationError({key: [str(error)]}) from None
    return fields


class WaitObjectiveListView(TenantAPIView):
    """Queue-wait objectives (SLOs): everyone sees them and how they stand; admins set them."""

    @extend_schema(responses=WaitObjectiveIn(many=True), summary="Queue-wait objectives and how they stand")
    def get(self, request: Request) -> Response:
        rows = WaitObjective.objects.select_related("policy", "compute_resource")
        return Response([_objective_out(objective) for objective in rows])

    @extend_schema(
        request=WaitObjectiveIn, responses={201: WaitObjectiveIn}, summary="Set a queue-wait objective"
    )
    def post(self, request: Request) -> Response:
        data = WaitObjectiveIn(data=request.data)
        data.is_valid(raise_exception=True)
        objective = objectives.objective_save(**_objective_fields(data.validated_data))
        return Response(_objective_out(objective), status=status.HTTP_201_CREATED)


class WaitObjectiveDetailView(TenantAPIView):
    @extend_schema(
        responses=WaitObjectiveIn,
        summary="One objective and how it stands, with why tasks wait and its hourly trend over its window "
        "(?hours= for fewer)",
    )
    def get(self, request: Request, objective_id: str) -> Response:
        objective = get_object_or_404(WaitObjective, pk=objective_id)
        window_hours = max(1, objective.window_seconds // 3600)
        hours = request.query_params.get("hours")
        if hours is not None and not (hours.isdigit() and 1 <= int(hours) <= window_hours):
            raise serializers.ValidationError(
                {"hours": [f"hours is a whole number from 1 to the window's {window_hours}."]}
            )
        trend = objectives.trend(objective, hours=int(hours) if hours else window_hours)
        return Response({**_objective_out(objective), "trend": trend})

    @extend_schema(request=WaitObjectiveIn, responses=WaitObjectiveIn, summary="Change an objective")
    def put(self, request: Request, objective_id: str) -> Response:
        objective = get_object_or_404(WaitObjective, pk=objective_id)
        data = WaitObjectiveIn(data=request.data)
        data.is_valid(raise_exception=True)
        objective = objectives.objective_save(objective=objective, **_objective_fields(data.validated_data))
        return Response(_objective_out(objective))

    @extend_schema(responses={204: None}, summary="Remove an objective")
    def delete(self, request: Request, objective_id: str) -> Response:
        get_object_or_404(WaitObjective, pk=objective_id).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class WebhookIn(serializers.Serializer[EventWebhook]):
    url = serializers.CharField(max_length=500, help_text="https://, at a public address")
    secret_name = serializers.CharField(max_length=128, help_text="a tenant secret: the HMAC-SHA256 key")
    kinds = serializers.ListField(
        child=serializers.CharField(max_length=50), required=False, default=list, help_text="[] for all"
    )


class WebhookOut(serializers.ModelSerializer[EventWebhook]):
    class Meta:
        model = EventWebhook
        fields = ["id", "url", "secret_name", "kinds", "created_by", "created_at"]


class DeliveryOut(serializers.ModelSerializer[WebhookDelivery]):
    class Meta:
        model = WebhookDelivery
        fields = [
            "id",
            "kind",
            "status",
            "attempts",
            "next_attempt_at",
            "last_error",
            "delivered_at",
            "created_at",
        ]


class WebhookListView(TenantAPIView):
    """The tenant's webhooks: where announcements (queue-wait objectives' changes) are sent (admins)."""

    read_role = Role.ADMIN

    @extend_schema(responses=WebhookOut(many=True), summary="The tenant's webhooks")
    def get(self, request: Request) -> Response:
        return self.page(EventWebhook.objects.all(), WebhookOut)

    @extend_schema(request=WebhookIn, responses={201: WebhookOut}, summary="Add a webhook")
    def post(self, request: Request) -> Response:
        data = WebhookIn(data=request.data)
        data.is_valid(raise_exception=True)
        hook = webhooks.webhook_save(actor=self.user.username, **data.validated_data)
        return Response(WebhookOut(hook).data, status=status.HTTP_201_CREATED)


class WebhookDetailView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses={204: None}, summary="Remove a webhook and its delivery log")
    def delete(self, request: Request, webhook_id: str) -> Response:
        get_object_or_404(EventWebhook, pk=webhook_id).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class WebhookDeliveriesView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses=DeliveryOut(many=True), summary="A webhook's deliveries, newest first")
    def get(self, request: Request, webhook_id: str) -> Response:
        hook = get_object_or_404(EventWebhook, pk=webhook_id)
        return self.page(WebhookDelivery.objects.filter(webhook=hook), DeliveryOut)
