"""The REST API of the AI agents acting for the caller: each delegated token with what it submitted,
holds and spent, and revoking one at once (optionally cancelling what it left unfinished)."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import ApiToken, Role, User
from apps.mcp import selectors, services


class DelegationOut(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    name = serializers.CharField()
    agent = serializers.CharField()
    user = serializers.CharField()
    token = serializers.CharField(help_text="the token's public prefix")
    scope = serializers.CharField()
    gpu_quota = serializers.CharField(allow_null=True, help_text="GPUs its unfinished tasks may hold")
    active = serializers.BooleanField()
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    revoked_at = serializers.DateTimeField(allow_null=True)
    last_used_at = serializers.DateTimeField(allow_null=True)
    tasks_submitted = serializers.IntegerField()
    tasks_unfinished = serializers.IntegerField()
    holds_gpus = serializers.CharField(help_text="GPUs its unfinished tasks hold or ask for now")
    gpu_hours = serializers.CharField(help_text="GPU-hours of its tasks' runs, from the ledger")
    gateway_calls = serializers.IntegerField()
    tokens_in = serializers.IntegerField()
    tokens_out = serializers.IntegerField()
    cost_usd = serializers.CharField(help_text="its GPU time and gateway calls, at the tenant's prices")


class RevokeIn(serializers.Serializer[Any]):
    cancel_tasks = serializers.BooleanField(default=False, help_text="also cancel its unfinished tasks")


class RevokedOut(DelegationOut):
    cancelled_tasks = serializers.IntegerField()


class DelegationListView(TenantAPIView):
    @extend_schema(
        parameters=[OpenApiParameter("everyone", bool, description="every person's agents (tenant admins)")],
        responses=DelegationOut(many=True),
        summary="The AI agents acting for you: each delegated token, what it submitted, holds and spent",
    )
    def get(self, request: Request) -> Response:
        everyone = request.query_params.get("everyone") in ("true", "1")
        tokens = list(selectors.delegated_tokens(self.user, everyone=everyone))
        rows = [delegation.view() for delegation in selectors.delegations(tokens)]
        return Response({"count": len(rows), "results": rows})


def _delegation(user: User, token_id: str) -> ApiToken:
    """One of the user's agents; any person's for a tenant admin (as with tokens)."""
    found: ApiToken = get_object_or_404(selectors.delegated_tokens(user, everyone=True), pk=token_id)
    return found


class DelegationDetailView(TenantAPIView):
    @extend_schema(responses=DelegationOut, summary="One AI agent acting for you (anyone's, for an admin)")
    def get(self, request: Request, token_id: str) -> Response:
        return Response(selectors.delegations([_delegation(self.user, token_id)])[0].view())


class DelegationRevokeView(TenantAPIView):
    write_role = Role.VIEWER  # anyone may stop an agent acting for them

    @extend_schema(
        request=RevokeIn,
        responses=RevokedOut,
        summary="Revoke an agent's token at once (its next call anywhere is refused); cancel_tasks also "
        "cancels the tasks it left unfinished",
    )
    def post(self, request: Request, token_id: str) -> Response:
        token = _delegation(self.user, token_id)
        data = RevokeIn(data=request.data)
        data.is_valid(raise_exception=True)
        cancelled = services.delegation_revoke(
            tenant=self.tenant, user=self.user, token=token, cancel_tasks=data.validated_data["cancel_tasks"]
        )
        token.refresh_from_db()
        view = selectors.delegations([token])[0].view()
        return Response({**view, "cancelled_tasks": cancelled})
