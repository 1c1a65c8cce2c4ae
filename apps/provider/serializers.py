"""Shapes of the tenant and provider APIs."""

from __future__ import annotations

from rest_framework import serializers

from tenants.models import Domain, Tenant


class TenantOut(serializers.ModelSerializer[Tenant]):
    domains: serializers.SlugRelatedField[Domain] = serializers.SlugRelatedField(
        many=True, read_only=True, slug_field="domain"
    )

    class Meta:
        model = Tenant
        fields = ["slug", "name", "status", "suspended_reason", "gpu_share", "domains", "created_at"]


class TenantIn(serializers.Serializer[Tenant]):
    slug = serializers.CharField(
        max_length=40, help_text="Lowercase name; the tenant is reached at <slug>.<base>"
    )
    name = serializers.CharField(max_length=200, required=False, default="")
    admin_username = serializers.CharField(max_length=150)
    admin_email = serializers.EmailField(required=False, default="")
    gpu_share = serializers.IntegerField(min_value=0, required=False, allow_null=True, default=None)


class TenantPatch(serializers.Serializer[Tenant]):
    name = serializers.CharField(max_length=200, required=False)
    gpu_share = serializers.IntegerField(min_value=0, required=False, allow_null=True)


class TenantCreatedOut(TenantOut):
    admin_username = serializers.CharField()
    admin_token = serializers.CharField(help_text="The first admin's token. It is shown this once.")

    class Meta(TenantOut.Meta):
        fields = [*TenantOut.Meta.fields, "admin_username", "admin_token"]


class SuspendIn(serializers.Serializer[Tenant]):
    reason = serializers.CharField(max_length=500)
