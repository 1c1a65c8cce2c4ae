"""Route each request to its tenant's schema by Host, or explain why it cannot be routed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.module_loading import import_string
from django_tenants.utils import get_public_schema_name

from apps.core.logging import tenant_var
from tenants.selectors import Read, tenant_enter_reading


class EnterRead(Protocol):
    """A read of the tenant's own schema that a request needs at once, made in the round trip that
    finds the tenant (settings.TENANT_ENTER_READ names it; apps.accounts.authentication.BearerRead reads
    the bearer token's row)."""

    @staticmethod
    def query(request: HttpRequest) -> tuple[Read, list[Any]] | None: ...

    @staticmethod
    def received(request: HttpRequest, row: tuple[Any, ...] | None) -> None: ...


class TenantMiddleware:
    """Select the schema of the tenant whose domain is the request's Host.

    Unlike django-tenants' own middleware, an unknown host gets a JSON 404 that says what addresses
    exist, and a suspended tenant gets a 403 whose sentence says why, before any view runs.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        name = getattr(settings, "TENANT_ENTER_READ", None)
        self.read: EnterRead | None = import_string(name) if name else None

    def __call__(self, request: HttpRequest) -> HttpResponse:
        # Not request.get_host(): an unknown host should hear about tenants, not about ALLOWED_HOSTS.
        host = request.META.get("HTTP_HOST", request.META.get("SERVER_NAME", "")).split(":")[0].lower()
        query = self.read.query(request) if self.read is not None else None
        # The tenant, the connection's schema with it, and what the request reads at once in that schema.
        tenant, row = tenant_enter_reading(host, *(query or ()))
        base = settings.KLIQUE_BASE_DOMAIN
        if tenant is None:
            return JsonResponse(
                {
                    "detail": f"No tenant is served at {host!r}. Tenants are reached at <tenant>.{base} "
                    f"and the provider at {base}; check the address or ask your provider for yours."
                },
                status=404,
            )
        if tenant.is_suspended:
            return JsonResponse(
                {
                    "detail": f"Tenant {tenant.slug} is suspended: {tenant.suspended_reason} "
                    "Contact your platform provider to restore access."
                },
                status=403,
            )
        request.tenant = tenant  # type: ignore[attr-defined]
        if query is not None and self.read is not None:
            self.read.received(request, row)
        tenant.domain_url = host
        tenant_var.set(tenant.slug)
        if tenant.schema_name == get_public_schema_name():
            request.urlconf = settings.PUBLIC_SCHEMA_URLCONF
        return self.get_response(request)
