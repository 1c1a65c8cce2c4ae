"""The tenant's single sign-on settings (tenant admins). The client secret goes to the vault."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import Role
from apps.sso import services
from apps.sso.models import Provider

FIELDS = ["issuer", "client_id", "username_claim", "groups_claim", "admin_groups", "member_groups",
          "break_glass_passwords"]  # fmt: skip


class ProviderOut(serializers.ModelSerializer[Provider]):
    class Meta:
        model = Provider
        fields = [*FIELDS, "authorization_endpoint", "end_session_endpoint", "updated_at"]


class ProviderIn(serializers.ModelSerializer[Provider]):
    client_secret = serializers.CharField(required=False, write_only=True, max_length=1000)

    class Meta:
        model = Provider
        fields = [*FIELDS, "client_secret"]


class SsoView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses=ProviderOut, summary="The tenant's identity provider and claim mapping")
    def get(self, request: Request) -> Response:
        provider = Provider.objects.filter(pk=1).first()
        if provider is None:
            raise NotFound("No single sign-on is set up; PUT the issuer, client and claim mapping here.")
        return Response(ProviderOut(provider).data)

    @extend_schema(request=ProviderIn, responses=ProviderOut, summary="Set up single sign-on")
    def put(self, request: Request) -> Response:
        data = ProviderIn(data=request.data)
        data.is_valid(raise_exception=True)
        fields = dict(data.validated_data)
        client_secret = fields.pop("client_secret", None)
        provider = services.provider_save(user=self.user, fields=fields, client_secret=client_secret)
        return Response(ProviderOut(provider).data)
