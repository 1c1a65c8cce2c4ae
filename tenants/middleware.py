"""Route each request to its tenant's schema by Host, or explain why it cannot be routed."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django_tenants.utils import get_public_schema_name

from apps.core.logging import tenant_var
from tenants.selectors import tenant_enter


class TenantMiddleware:
    """Select the schema of the tenant whose domain is the request's Host.

    Unlike django-tenants' own middleware, an unknown host gets a JSON 404 that says what addresses
    exist, and a suspended tenant gets a 403 whose sentence says why, before any view runs.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        # Not request.get_host(): an unknown host should hear about tenants, not about ALLOWED_HOSTS.
        host = request.META.get("HTTP_HOST", request.META.get("SERVER_NAME", "")).split(":")[0].lower()
        tenant = tenant_enter(host)  # and the connection's schema with it
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
        tenant.domain_url = host
        tenant_var.set(tenant.slug)
        if tenant.schema_name == get_public_schema_name():
            request.urlconf = settings.PUBLIC_SCHEMA_URLCONF
        return self.get_response(request)
