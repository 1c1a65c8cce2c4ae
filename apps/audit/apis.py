"""The audit log, for tenant admins."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.apis import TenantAPIView
from apps.accounts.models import Role
from apps.audit.models import AuditEvent


class AuditEventOut(serializers.ModelSerializer[AuditEvent]):
    class Meta:
        model = AuditEvent
        fields = ["id", "at", "actor", "on_behalf_of", "action", "target", "detail", "request_id"]


class AuditListView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(
        responses=AuditEventOut(many=True),
        parameters=[
            OpenApiParameter(
                "action", str, description='e.g. "secret.read"; a prefix such as "secret." works'
            ),
            OpenApiParameter("actor", str),
        ],
        summary="Administrative actions and secret reads, newest first",
    )
    def get(self, request: Request) -> Response:
        events = AuditEvent.objects.all()
        if action := request.query_params.get("action"):
            events = events.filter(action__startswith=action)
        if actor := request.query_params.get("actor"):
            events = events.filter(actor=actor)
        return self.page(events, AuditEventOut)
