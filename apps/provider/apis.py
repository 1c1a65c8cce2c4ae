"""The tenant's own description (tenant domains) and the provider's tenant management (public domain)."""

from __future__ import annotations

from datetime import date
from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import ProviderView, TenantAPIView
from apps.core.errors import InvalidInput
from apps.provider import serializers, services
from apps.provider.selectors import usage_by_tenant
from tenants import selectors


class CurrentTenantView(TenantAPIView):
    @extend_schema(responses=serializers.TenantOut, summary="The tenant this address serves")
    def get(self, request: Request) -> Response:
        return Response(serializers.TenantOut(self.tenant).data)


class ProviderTenantListView(ProviderView):
    @extend_schema(responses=serializers.TenantOut(many=True), summary="All tenants")
    def get(self, request: Request) -> Response:
        return Response(serializers.TenantOut(selectors.tenant_list(), many=True).data)

    @extend_schema(
        request=serializers.TenantIn,
        responses={201: serializers.TenantCreatedOut},
        summary="Create a tenant with its schema, domain and first admin",
    )
    def post(self, request: Request) -> Response:
        data = serializers.TenantIn(data=request.data)
        data.is_valid(raise_exception=True)
        created = services.tenant_create(**data.validated_data)
        body: dict[str, Any] = {
            **serializers.TenantOut(created.tenant).data,
            "admin_username": created.admin_username,
            "admin_token": created.admin_token,
        }
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})


class ProviderTenantDetailView(ProviderView):
    @extend_schema(responses=serializers.TenantOut)
    def get(self, request: Request, slug: str) -> Response:
        return Response(serializers.TenantOut(self.tenant_or_404(slug)).data)

    @extend_schema(
        request=serializers.TenantPatch,
        responses=serializers.TenantOut,
        summary="Rename a tenant or set its GPU share",
    )
    def patch(self, request: Request, slug: str) -> Response:
        tenant = self.tenant_or_404(slug)
        data = serializers.TenantPatch(data=request.data)
        data.is_valid(raise_exception=True)
        tenant = services.tenant_update(tenant=tenant, **data.validated_data)
        return Response(serializers.TenantOut(tenant).data)

    @extend_schema(responses={204: None}, summary="Delete a tenant and all of its data")
    def delete(self, request: Request, slug: str) -> Response:
        services.tenant_delete(tenant=self.tenant_or_404(slug))
        return Response(status=status.HTTP_204_NO_CONTENT)


class ProviderTenantSuspendView(ProviderView):
    @extend_schema(
        request=serializers.SuspendIn,
        responses=serializers.TenantOut,
        summary="Suspend a tenant: its requests get 403 with the reason",
    )
    def post(self, request: Request, slug: str) -> Response:
        tenant = self.tenant_or_404(slug)
        data = serializers.SuspendIn(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(
            serializers.TenantOut(services.tenant_suspend(tenant=tenant, **data.validated_data)).data
        )


class ProviderTenantResumeView(ProviderView):
    @extend_schema(request=None, responses=serializers.TenantOut, summary="Lift a suspension")
    def post(self, request: Request, slug: str) -> Response:
        return Response(serializers.TenantOut(services.tenant_resume(tenant=self.tenant_or_404(slug))).data)


class ProviderUsageView(ProviderView):
    @extend_schema(
        summary="Usage and cost per tenant (per day with ?by=day), from the totals the ledger keeps in the "
        "public schema; filter with since and until (days)",
    )
    def get(self, request: Request) -> Response:
        return Response(usage_by_tenant(**_days(request)))


def _days(request: Request) -> dict[str, Any]:
    bounds: dict[str, Any] = {"by_day": request.query_params.get("by") == "day"}
    for name in ("since", "until"):
        value = request.query_params.get(name)
        if value:
            try:
                bounds[name] = date.fromisoformat(value)
            except ValueError:
                raise InvalidInput(f"{name}: a day, as 2026-11-01.", field=name) from None
    return bounds
