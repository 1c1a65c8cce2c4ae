"""The configuration API: the draft (edit, validate, provision), what is provisioned, pools and queues."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import extend_schema, extend_schema_field, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import Role
from apps.configuration import selectors, services
from apps.core.schema import DocumentField
from apps.fleet.selectors import NONE_REPORTED, Reported, agents_by_pool
from apps.resources.models import ComputeResource, Pool
from apps.scheduling import selectors as scheduling_selectors
from apps.scheduling.engine import to_gpus_text
from apps.scheduling.models import ACTIVE_STATES, Task


class DraftOut(serializers.Serializer[object]):
    document = serializers.JSONField()
    updated_at = serializers.DateTimeField()
    updated_by = serializers.CharField(source="updated_by.username", allow_null=True, default=None)
    provisioned_at = serializers.DateTimeField(allow_null=True)


class DraftIn(serializers.Serializer[object]):
    document = DocumentField(help_text="pools, profiles and policies; see the README")


class ReportItem(serializers.Serializer[object]):
    where = serializers.CharField()
    message = serializers.CharField()


# `errors` is taken on Serializer classes, so the report's schema is built inline.
ReportOut = inline_serializer(
    "ValidationReport",
    fields={
        "ok": serializers.BooleanField(),
        "errors": ReportItem(many=True),
        "warnings": ReportItem(many=True),
    },
)


class DraftView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses=DraftOut, summary="The configuration draft")
    def get(self, request: Request) -> Response:
        return Response(DraftOut(services.draft_get()).data)

    @extend_schema(request=DraftIn, responses=DraftOut, summary="Replace the draft (its shape is checked)")
    def put(self, request: Request) -> Response:
        data = DraftIn(data=request.data)
        data.is_valid(raise_exception=True)
        draft = services.draft_save(
            tenant=self.tenant, user=self.user, document=data.validated_data["document"]
        )
        return Response(DraftOut(draft).data)


class DraftValidateView(TenantAPIView):
    @extend_schema(request=None, responses=ReportOut, summary="Check the draft: errors block provisioning")
    def post(self, request: Request) -> Response:
        return Response(services.draft_validate().as_dict())


class DraftProvisionView(TenantAPIView):
    @extend_schema(request=None, summary="Make the draft the configuration, atomically")
    def post(self, request: Request) -> Response:
        result = services.draft_provision(tenant=self.tenant, user=self.user)
        return Response(
            {
                **result.report.as_dict(),
                "created": result.created,
                "deleted": result.deleted,
                "ended_tasks": result.ended_tasks,
            }
        )


class SimulateIn(serializers.Serializer[object]):
    days = serializers.IntegerField(min_value=1, max_value=90, required=False, allow_null=True, default=None)
    trace = serializers.CharField(
        required=False,
        allow_null=True,
        default=None,
        max_length=20_000_000,
        help_text="CSV with columns timestamp,duration,num_gpus,compute_resource",
    )
    interval_seconds = serializers.FloatField(min_value=1, max_value=3600, required=False, default=60.0)


class DraftSimulateView(TenantAPIView):
    @extend_schema(
        request=SimulateIn, summary="Replay recent work (or a trace) against the draft and the current setup"
    )
    def post(self, request: Request) -> Response:
        data = SimulateIn(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        result = services.draft_simulate(
            days=values["days"], trace=values["trace"], interval=values["interval_seconds"]
        )
        return Response(result.as_dict())


class ActiveConfigurationView(TenantAPIView):
    @extend_schema(summary="The provisioned configuration, as a document")
    def get(self, request: Request) -> Response:
        return Response(services.export_active())


class PoolOut(serializers.ModelSerializer[Pool]):
    online = serializers.SerializerMethodField()
    used_gpus = serializers.SerializerMethodField()
    workers = serializers.SerializerMethodField(help_text="Agents connected now.")
    cpus = serializers.SerializerMethodField(help_text="CPUs its agents report; null when none says.")
    cpus_in_use = serializers.SerializerMethodField(help_text="Of those, busy (load) or held by jobs.")
    nodes = serializers.SerializerMethodField(help_text="Hosts or cluster nodes its agents report.")
    gpu_classes = serializers.SerializerMethodField(
        help_text="GPUs per class and resource (MIG profiles apart) its cluster agents count: allocatable "
        "on the nodes, and allocated to running pods."
    )
    problems = serializers.SerializerMethodField(
        help_text="What stops its agents' environments from taking work, in their words (RBAC, credentials)."
    )

    class Meta:
        model = Pool
        fields = [
            "id",
            "name",
            "environment",
            "capacity_gpus",
            "gpu_class",
            "region",
            "sharing",
            "cost_tier",
            "heartbeat_timeout_seconds",
            "last_heartbeat_at",
            "online",
            "used_gpus",
            "workers",
            "cpus",
            "cpus_in_use",
            "nodes",
            "gpu_classes",
            "problems",
        ]

    def get_online(self, pool: Pool) -> bool:
        return pool.is_online(self.context["now"])

    def _reported(self, pool: Pool) -> Reported:
        reported: Reported = self.context["agents"].get(pool.pk, NONE_REPORTED)
        return reported

    def get_workers(self, pool: Pool) -> int:
        return self._reported(pool).workers

    def get_cpus(self, pool: Pool) -> int | None:
        return self._reported(pool).cpus

    def get_cpus_in_use(self, pool: Pool) -> int | None:
        return self._reported(pool).cpus_in_use

    def get_nodes(self, pool: Pool) -> int | None:
        return self._reported(pool).nodes

    @extend_schema_field(
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "class": {"type": "string"},
                    "resource": {"type": "string"},
                    "allocatable": {"type": "integer"},
                    "allocated": {"type": "integer"},
                },
            },
        }
    )
    def get_gpu_classes(self, pool: Pool) -> list[dict[str, Any]]:
        return list(self._reported(pool).gpus)

    def get_problems(self, pool: Pool) -> list[str]:
        return list(self._reported(pool).problems)

    def get_used_gpus(self, pool: Pool) -> str:
        return to_gpus_text(self.context["used"].get(pool.pk, 0))


class PoolListView(TenantAPIView):
    @extend_schema(
        responses=PoolOut(many=True), summary="Pools, with whether they are online and what is used"
    )
    def get(self, request: Request) -> Response:
        used: dict[object, int] = {}
        for pool_id, size in Task.objects.filter(state__in=ACTIVE_STATES).values_list(
            "pool_id", "size_units"
        ):
            used[pool_id] = used.get(pool_id, 0) + size
        context = {"now": timezone.now(), "used": used, "agents": agents_by_pool()}
        return self.page(Pool.objects.all(), lambda rows, many: PoolOut(rows, many=many, context=context))


class ComputeResourceOut(serializers.ModelSerializer[ComputeResource]):
    policy = serializers.CharField(source="policy.name")
    group = serializers.CharField(source="policy.group.name")
    profile = serializers.CharField(source="profile.name")
    reservation_gpus = serializers.SerializerMethodField()
    limit_gpus = serializers.SerializerMethodField()
    size = serializers.SerializerMethodField()
    queued = serializers.SerializerMethodField()
    active = serializers.SerializerMethodField()
    open_to_you = serializers.SerializerMethodField()
    wait_p50_seconds = serializers.SerializerMethodField()
    wait_p95_seconds = serializers.SerializerMethodField()

    class Meta:
        model = ComputeResource
        fields = [
            "id",
            "name",
            "policy",
            "group",
            "profile",
            "queuing_priority",
            "reservation_gpus",
            "limit_gpus",
            "size",
            "queued",
            "active",
            "open_to_you",
            "wait_p50_seconds",
            "wait_p95_seconds",
        ]

    def get_reservation_gpus(self, resource: ComputeResource) -> str:
        return to_gpus_text(resource.policy.reservation_units)

    def get_limit_gpus(self, resource: ComputeResource) -> str:
        return to_gpus_text(resource.policy.limit_units)

    def get_size(self, resource: ComputeResource) -> str:
        return resource.profile.size_text()

    def _depth(self, resource: ComputeResource) -> dict[str, int]:
        depths: dict[str, dict[str, int]] = self.context["depths"]
        return depths.get(str(resource.pk), {"queued": 0, "active": 0})

    def get_queued(self, resource: ComputeResource) -> int:
        return self._depth(resource)["queued"]

    def get_active(self, resource: ComputeResource) -> int:
        return self._depth(resource)["active"]

    def get_open_to_you(self, resource: ComputeResource) -> bool:
        return resource.pk in self.context["open"]

    def get_wait_p50_seconds(self, resource: ComputeResource) -> float | None:
        stats = self.context["waits"].get(str(resource.pk))
        return None if stats is None else stats.p50_seconds

    def get_wait_p95_seconds(self, resource: ComputeResource) -> float | None:
        stats = self.context["waits"].get(str(resource.pk))
        return None if stats is None else stats.p95_seconds


class ComputeResourceListView(TenantAPIView):
    @extend_schema(
        responses=ComputeResourceOut(many=True),
        summary="Compute resources; open_to_you says where you may submit",
    )
    def get(self, request: Request) -> Response:
        context = selectors.compute_resource_figures(self.user)
        return self.page(
            scheduling_selectors.compute_resources(),
            lambda rows, many: ComputeResourceOut(rows, many=many, context=context),
        )


class ComputeResourceDetailView(TenantAPIView):
    @extend_schema(responses=ComputeResourceOut)
    def get(self, request: Request, resource_id: str) -> Response:
        resource = get_object_or_404(scheduling_selectors.compute_resources(), pk=resource_id)
        return Response(
            ComputeResourceOut(resource, context=selectors.compute_resource_figures(self.user)).data
        )


class BatchPreviewIn(serializers.Serializer[object]):
    scheduler = serializers.ChoiceField(choices=services.HPC_ENVIRONMENTS, required=False)
    template = serializers.CharField(max_length=20_000, required=False, trim_whitespace=False)
    gpus = serializers.CharField(max_length=20, required=False)
    name = serializers.CharField(max_length=200, required=False, default="", allow_blank=True)
    spec = serializers.DictField(required=False, default=dict)


class BatchPreviewOut(serializers.Serializer[object]):
    scheduler = serializers.CharField()
    template_from = serializers.CharField()
    script = serializers.CharField()
    submit = serializers.ListField(child=serializers.CharField())


class BatchPreviewView(TenantAPIView):
    write_role = Role.MEMBER
    submit_scope = True

    @extend_schema(
        request=BatchPreviewIn,
        responses=BatchPreviewOut,
        summary="The batch script a task would get on this compute resource's HPC pools",
    )
    def post(self, request: Request, resource_id: str) -> Response:
        resource = get_object_or_404(scheduling_selectors.compute_resources(), pk=resource_id)
        data = BatchPreviewIn(data=request.data)
        data.is_valid(raise_exception=True)
        preview = services.batch_preview(
            resource=resource,
            user=self.user,
            url=request.build_absolute_uri("/").rstrip("/"),
            scheduler=data.validated_data.get("scheduler"),
            template=data.validated_data.get("template"),
            gpus=data.validated_data.get("gpus"),
            name=data.validated_data["name"],
            spec=data.validated_data["spec"],
        )
        return Response(BatchPreviewOut(preview).data)


class PoolQueueView(TenantAPIView):
    @extend_schema(
        responses=inline_serializer(
            "PoolQueue",
            {
                "pool": serializers.CharField(),
                "environment": serializers.CharField(),
                "agents": serializers.ListField(child=serializers.DictField()),
            },
        ),
        summary="The cluster's own queue of Klique's jobs in this pool, as its agents last saw it",
    )
    def get(self, request: Request, pool_id: str) -> Response:
        pool = get_object_or_404(Pool, pk=pool_id)
        agents = [
            {
                "agent": agent.id,
                "connected": agent.connected,
                "as_of": agent.last_heartbeat_at,
                "jobs": agent.queue,
            }
            for agent in pool.agents.all()
        ]
        return Response({"pool": pool.name, "environment": pool.environment, "agents": agents})
