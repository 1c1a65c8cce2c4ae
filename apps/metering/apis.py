"""The usage API: the ledger's events, summaries from its rollups, the price book, imports and refusals."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import Role
from apps.core.errors import InvalidInput
from apps.metering import exports, selectors, services
from apps.metering.models import LedgerEvent, Period, Rejection
from protocol.units import UNITS_PER_GPU


class EventOut(serializers.ModelSerializer[LedgerEvent]):
    gpus = serializers.SerializerMethodField()
    gpu_hours = serializers.SerializerMethodField()
    cost_usd = serializers.SerializerMethodField()

    class Meta:
        model = LedgerEvent
        fields = [
            "event_id", "kind", "started_at", "ended_at", "period", "late", "username", "project_name",
            "cost_center", "group_name", "pool", "gpu_class", "compute_resource", "gpus", "gpu_hours",
            "model", "tokens_in", "tokens_out", "cost_usd", "source",
        ]  # fmt: skip

    def get_gpus(self, event: LedgerEvent) -> str:
        return str(Fraction(event.gpu_units, UNITS_PER_GPU))

    def get_gpu_hours(self, event: LedgerEvent) -> str:
        return selectors.gpu_hours_text(event.gpu_unit_ms)

    def get_cost_usd(self, event: LedgerEvent) -> str:
        return selectors.usd_text(event.cost_nano_usd)


class UsageListView(TenantAPIView):
    @extend_schema(
        responses=EventOut(many=True),
        summary="Ledger events (yours; admins everyone's): filter by kind, user, project, pool, since, until",
    )
    def get(self, request: Request) -> Response:
        events = selectors.usage_filtered(
            selectors.usage_for(self.user), request.query_params.dict(), time_field="started_at"
        )
        return self.page(events.order_by("-started_at"), EventOut)


class UsageSummaryView(TenantAPIView):
    @extend_schema(
        summary="Totals from the hourly or daily rollups, grouped by project, user, pool, gpu_class, "
        "model or kind (yours; admins everyone's): GPU-hours, tokens, GB-hours, cost",
    )
    def get(self, request: Request) -> Response:
        query = request.query_params
        bounds = {key: str(query[key]) for key in ("kind", "since", "until") if query.get(key)}
        summary = selectors.usage_summary(
            user_id=None if self.user.has_role(Role.ADMIN) else self.user.pk,
            by=query.get("by", "project"),
            grain=query.get("grain", "day"),
            bounds=bounds,
        )
        return Response(summary)


class ImportIn(serializers.Serializer[Any]):
    events = serializers.ListField(child=serializers.JSONField(), max_length=10_000)


class UsageImportView(TenantAPIView):
    @extend_schema(
        request=ImportIn,
        summary="Record usage events from elsewhere (admin): each is checked; the report says which were "
        "new, which were already there, and which were refused and why",
    )
    def post(self, request: Request) -> Response:
        data = ImportIn(data=request.data)
        data.is_valid(raise_exception=True)
        report = services.import_events(data.validated_data["events"])
        body = {
            "accepted": report.accepted,
            "duplicates": report.duplicates,
            "rejected": [{"event_id": event_id, "reason": reason} for event_id, reason in report.rejected],
        }
        return Response(body, status=status.HTTP_201_CREATED if report.accepted else status.HTTP_200_OK)


class RejectionOut(serializers.ModelSerializer[Rejection]):
    class Meta:
        model = Rejection
        fields = ["event_id", "reason", "payload", "at"]


class RejectionListView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses=RejectionOut(many=True), summary="Events the ledger refused, and why (admin)")
    def get(self, request: Request) -> Response:
        return self.page(selectors.rejections(), RejectionOut)


class PriceBookIO(serializers.Serializer[Any]):
    gpu_hour = serializers.DictField(help_text='USD per GPU-hour by GPU class; "*" for any other')
    tokens_million = serializers.DictField(
        help_text='{"<model>": {"in": USD, "out": USD}} per million tokens'
    )
    gb_month = serializers.DecimalField(max_digits=12, decimal_places=6, help_text="USD per GB kept 30 days")
    instance_hour = serializers.DictField(
        required=False, default=dict, help_text='USD per hour of a cloud instance by type; "*" for any other'
    )


def _prices(book: Any) -> dict[str, Any]:
    return {
        "gpu_hour": book.gpu_hour,
        "tokens_million": book.tokens_million,
        "gb_month": str(book.gb_month),
        "instance_hour": book.instance_hour,
    }


class PriceBookView(TenantAPIView):
    @extend_schema(responses=PriceBookIO, summary="The tenant's prices")
    def get(self, request: Request) -> Response:
        book = selectors.price_book()
        return Response(_prices(book))

    @extend_schema(request=PriceBookIO, responses=PriceBookIO, summary="Set the tenant's prices (admin)")
    def put(self, request: Request) -> Response:
        data = PriceBookIO(data=request.data)
        data.is_valid(raise_exception=True)
        book = services.price_book_save(**data.validated_data)
        return Response(_prices(book))


class PeriodOut(serializers.ModelSerializer[Period]):
    period = serializers.SerializerMethodField()

    class Meta:
        model = Period
        fields = ["period", "start", "closed_at"]

    def get_period(self, period: Period) -> str:
        return f"{period.start:%Y-%m}"


class PeriodListView(TenantAPIView):
    @extend_schema(responses=PeriodOut(many=True), summary="Billing months, open or closed")
    def get(self, request: Request) -> Response:
        return self.page(selectors.periods(), PeriodOut)


class PeriodCloseView(TenantAPIView):
    @extend_schema(responses=PeriodOut, summary="Close a month (admin): later events for it land in the next")
    def post(self, request: Request, period: str) -> Response:
        return Response(PeriodOut(services.period_close(start=services.period_of(period))).data)


class ChargebackView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(
        summary="A month's chargeback file (admin): usage and cost per cost center, project, kind, GPU class "
        "and model; ?period=2026-11&file=csv|parquet",
    )
    def get(self, request: Request) -> HttpResponse:
        period = services.period_of(request.query_params.get("period", ""))
        kind = request.query_params.get("file", "csv")  # not `format`: DRF reads that one itself
        if kind not in ("csv", "parquet"):
            raise InvalidInput("file is csv or parquet.", field="file")
        rows = exports.chargeback(period)
        body = exports.to_csv(rows) if kind == "csv" else exports.to_parquet(rows)
        response = HttpResponse(
            body, content_type="text/csv" if kind == "csv" else "application/vnd.apache.parquet"
        )
        name = f"klique-{self.tenant.slug}-{period:%Y-%m}-chargeback.{kind}"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
