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
from apps.scheduling import selectors, services
from apps.scheduling.engine import to_gpus_text
from apps.scheduling.models import Task, TaskEvent, TaskState


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
