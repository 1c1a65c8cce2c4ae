"""The provider's billing API: export a month to Stripe, see the pushes, reconcile."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import ProviderView
from apps.billing import services
from apps.billing.models import StripePush
from apps.core.errors import InvalidInput
from apps.metering.services import period_of


class PushOut(serializers.ModelSerializer[StripePush]):
    tenant = serializers.CharField(source="tenant.slug")
    period = serializers.SerializerMethodField()

    class Meta:
        model = StripePush
        fields = [
            "tenant", "period", "kind", "quantity", "amount_cents", "mode", "status", "attempts",
            "last_error", "stripe_id", "idempotency_key", "sent_at",
        ]  # fmt: skip

    def get_period(self, push: StripePush) -> str:
        return f"{push.period:%Y-%m}"


class ExportIn(serializers.Serializer[Any]):
    period = serializers.CharField(help_text="a month that is over, as 2026-11")


def _stripe(function: Any, *args: Any) -> Any:
    try:
        return function(*args)
    except services.StripeUnavailable as unavailable:
        raise InvalidInput(str(unavailable)) from None


class BillingExportView(ProviderView):
    @extend_schema(
        request=ExportIn,
        responses=PushOut(many=True),
        summary="Push a month's usage of every tenant to Stripe (once; what Stripe cannot take is retried)",
    )
    def post(self, request: Request) -> Response:
        data = ExportIn(data=request.data)
        data.is_valid(raise_exception=True)
        period = period_of(data.validated_data["period"])
        pushes = services.export_period(period)
        _stripe(services.push_pending)
        return Response(PushOut(StripePush.objects.filter(pk__in=[p.pk for p in pushes]), many=True).data)


class BillingPushListView(ProviderView):
    @extend_schema(responses=PushOut(many=True), summary="Usage pushes to Stripe and where each stands")
    def get(self, request: Request) -> Response:
        pushes = StripePush.objects.select_related("tenant")
        if request.query_params.get("period"):
            pushes = pushes.filter(period=period_of(request.query_params["period"]))
        return Response(PushOut(pushes, many=True).data)


class ReconciliationView(ProviderView):
    @extend_schema(
        summary="What Stripe holds for a month beside what each tenant's ledger says (?period=2026-11)"
    )
    def get(self, request: Request) -> Response:
        period = period_of(request.query_params.get("period", ""))
        rows = _stripe(services.reconcile, period)
        fields = ("tenant", "kind", "ledger_cents", "stripe_cents", "state", "source")
        return Response([{name: getattr(row, name) for name in fields} for row in rows])


class ProviderPricesIO(serializers.Serializer[Any]):
    gpu_hour = serializers.DictField(
        help_text='USD per GPU-hour by GPU class; "*" for any other',
        required=False,
        default=dict,
    )
    tokens_million = serializers.DictField(
        help_text='{"<model>": {"in": USD, "out": USD}} per million tokens; "*" for any other model',
        required=False,
        default=dict,
    )
    gb_month = serializers.CharField(
        help_text="USD per GB kept 30 days; null: storage is not invoiced", allow_null=True, required=False
    )


def _prices_out(book: Any) -> dict[str, Any]:
    gb_month = None if book.gb_month is None else str(book.gb_month)
    return {"gpu_hour": book.gpu_hour, "tokens_million": book.tokens_million, "gb_month": gb_month}


class ProviderPricesView(ProviderView):
    @extend_schema(responses=ProviderPricesIO, summary="What the provider charges its tenants (invoices)")
    def get(self, request: Request) -> Response:
        return Response(_prices_out(services.provider_prices()))

    @extend_schema(
        request=ProviderPricesIO,
        responses=ProviderPricesIO,
        summary="Set what the provider charges its tenants; a tenant's own price book is its chargeback's",
    )
    def put(self, request: Request) -> Response:
        data = ProviderPricesIO(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        book = services.provider_prices_save(
            gpu_hour=values["gpu_hour"],
            tokens_million=values["tokens_million"],
            gb_month=values.get("gb_month"),
        )
        return Response(_prices_out(book))
