"""The gateway's REST API: its configuration (admins), budgets and wallets, and the usage it metered."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import Role
from apps.core.schema import AmountField, DocumentField
from gateway import selectors, services, wallets
from gateway.budgets import usd
from gateway.models import Budget, Usage


class SettingsOut(serializers.Serializer[Any]):
    document = serializers.JSONField()
    updated_at = serializers.DateTimeField(allow_null=True)
    updated_by = serializers.CharField(allow_null=True)


class SettingsIn(serializers.Serializer[Any]):
    document = DocumentField(help_text="model_list, router_settings and guardrails (see docs/gateway.md)")


def _settings_out(row: Any) -> dict[str, Any]:
    return {
        "document": row.document,
        "updated_at": row.updated_at,
        "updated_by": row.updated_by.username if row.updated_by else None,
    }


class GatewaySettingsView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(
        responses=SettingsOut, summary="The gateway's configuration: models, routing, prices, guardrails"
    )
    def get(self, request: Request) -> Response:
        return Response(SettingsOut(_settings_out(selectors.settings_get())).data)

    @extend_schema(request=SettingsIn, responses=SettingsOut, summary="Replace the gateway's configuration")
    def put(self, request: Request) -> Response:
        data = SettingsIn(data=request.data)
        data.is_valid(raise_exception=True)
        row = services.settings_save(user=self.user, document=data.validated_data["document"])
        return Response(SettingsOut(_settings_out(row)).data)


class BudgetOut(serializers.ModelSerializer[Budget]):
    project = serializers.CharField(source="project.name", allow_null=True, default=None)
    user = serializers.CharField(source="user.username", allow_null=True, default=None)
    name = serializers.SerializerMethodField(help_text="what the budget is, as refusals name it")
    spent = serializers.SerializerMethodField(
        help_text="spent this period, from the usage ledger, in the unit"
    )

    class Meta:
        model = Budget
        fields = ["id", "name", "scope", "project", "user", "unit", "limit", "period", "spent", "created_at"]

    def get_name(self, budget: Budget) -> str:
        return wallets.budget_label(budget)

    def get_spent(self, budget: Budget) -> str:
        spent = wallets.ledger_spent(wallets.enforced(budget), now=datetime.now(UTC))
        return wallets.amount_text(budget.unit, spent)


class BudgetIn(serializers.Serializer[Budget]):
    scope = serializers.ChoiceField(choices=Budget.Scope.choices)
    project = serializers.CharField(required=False, help_text="the project's name or id, for scope project")
    user = serializers.CharField(required=False, help_text="the username or id, for scope user")
    unit = serializers.ChoiceField(choices=Budget.Unit.choices, default=Budget.Unit.TOKENS)
    limit = AmountField(min_value=Decimal(0))
    period = serializers.ChoiceField(choices=Budget.Period.choices, default=Budget.Period.MONTH)


class BudgetPatch(serializers.Serializer[Budget]):
    limit = AmountField(min_value=Decimal(0), required=False, help_text="the new limit; absent: unchanged")


class TopUpIn(serializers.Serializer[Budget]):
    amount = AmountField()


class BudgetListView(TenantAPIView):
    @extend_schema(
        responses=BudgetOut(many=True), summary="Gateway budgets and wallets that apply to you (admins: all)"
    )
    def get(self, request: Request) -> Response:
        return self.page(selectors.budgets_visible_to(self.user), BudgetOut)

    @extend_schema(
        request=BudgetIn, responses={201: BudgetOut}, summary="Set a budget or wallet (period none)"
    )
    def post(self, request: Request) -> Response:
        data = BudgetIn(data=request.data)
        data.is_valid(raise_exception=True)
        budget = services.budget_create(**data.validated_data)
        return Response(BudgetOut(budget).data, status=status.HTTP_201_CREATED)


class BudgetDetailView(TenantAPIView):
    @extend_schema(responses=BudgetOut)
    def get(self, request: Request, budget_id: str) -> Response:
        return Response(
            BudgetOut(get_object_or_404(selectors.budgets_visible_to(self.user), pk=budget_id)).data
        )

    @extend_schema(request=BudgetPatch, responses=BudgetOut, summary="Change a budget's limit")
    def patch(self, request: Request, budget_id: str) -> Response:
        budget = get_object_or_404(selectors.budgets_visible_to(self.user), pk=budget_id)
        data = BudgetPatch(data=request.data)
        data.is_valid(raise_exception=True)
        if not data.validated_data:  # a PATCH that changes nothing
            return Response(BudgetOut(budget).data)
        return Response(BudgetOut(services.budget_update(budget=budget, **data.validated_data)).data)

    @extend_schema(responses={204: None}, summary="Remove a budget")
    def delete(self, request: Request, budget_id: str) -> Response:
        get_object_or_404(selectors.budgets_visible_to(self.user), pk=budget_id).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class BudgetTopUpView(TenantAPIView):
    @extend_schema(request=TopUpIn, responses=BudgetOut, summary="Add to a wallet")
    def post(self, request: Request, budget_id: str) -> Response:
        budget = get_object_or_404(selectors.budgets_visible_to(self.user), pk=budget_id)
        data = TopUpIn(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(BudgetOut(services.budget_top_up(budget=budget, **data.validated_data)).data)


class UsageOut(serializers.ModelSerializer[Usage]):
    cost_usd = serializers.SerializerMethodField()

    class Meta:
        model = Usage
        fields = [
            "request_id",
            "at",
            "username",
            "project_name",
            "agent",
            "endpoint",
            "model",
            "deployment",
            "tokens_in",
            "tokens_out",
            "cost_usd",
            "status",
            "duration_ms",
        ]

    def get_cost_usd(self, row: Usage) -> str:
        return str(usd(row.cost_nano_usd))


class UsageListView(TenantAPIView):
    @extend_schema(
        responses=UsageOut(many=True),
        summary="Gateway calls as metered (yours; admins: everyone's), newest first; "
        "filter by user, project, model, status, since, until",
    )
    def get(self, request: Request) -> Response:
        rows = selectors.usage_for(self.user)
        query = request.query_params
        filters = {"username": "user", "project_name": "project", "model": "model", "status": "status"}
        for field, parameter in filters.items():
            if query.get(parameter):
                rows = rows.filter(**{field: query[parameter]})
        for bound, lookup in (("since", "at__gte"), ("until", "at__lt")):
            if query.get(bound):
                try:
                    rows = rows.filter(**{lookup: datetime.fromisoformat(query[bound])})
                except ValueError:
                    raise serializers.ValidationError(
                        {bound: ["An ISO 8601 time, as 2026-11-30T00:00:00Z."]}
                    ) from None
        return self.page(rows, UsageOut)
