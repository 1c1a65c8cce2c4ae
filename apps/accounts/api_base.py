"""The bases of every API view: a tenant's (who is asking, by bearer token or session; the role the view
names; paging) and the provider's; and the audit record of every change made through either (who, which
endpoint, what object; bodies are never recorded: they may hold a secret or a password)."""

from __future__ import annotations

from typing import Any

from django.http import Http404
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.models import ApiToken, Role, User
from apps.accounts.permissions import ProviderAdmin, TenantRole
from apps.audit.middleware import record_after
from apps.audit.services import record
from tenants import selectors as tenants
from tenants.models import Tenant


class Audited:
    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        user, method = getattr(request, "user", None), request.method or ""
        token = request.auth if isinstance(request.auth, ApiToken) else None
        if response.status_code == 403 and token is not None and token.agent:
            # A delegated token used beyond its scope: recorded by apps.audit.middleware once the
            # request's transaction (rolled back for the refusal) is over.
            detail = getattr(response, "data", None)
            record_after(
                request._request,
                actor=token.acting,
                on_behalf_of=token.user.username,
                action="token.refused",
                reason=str(detail.get("detail", "")) if isinstance(detail, dict) else "",
            )
        if method not in SAFE_METHODS and 200 <= response.status_code < 300 and isinstance(user, User):
            match = request.resolver_match
            action = f"{match.url_name if match is not None else 'api'}.{method.lower()}"
            acting = token.acting if token is not None else user.username  # "agent X for alice"
            on_behalf_of = user.username if acting != user.username else ""
            record(actor=acting, action=action, target=request.path, on_behalf_of=on_behalf_of)
        return response


class TenantAPIView(Audited, APIView):
    """Every tenant endpoint: a bearer token or session, and the role the view names."""

    permission_classes = [TenantRole]
    read_role: str = Role.VIEWER
    write_role: str = Role.ADMIN

    @property
    def tenant(self) -> Any:
        return self.request.tenant  # type: ignore[attr-defined]

    @property
    def user(self) -> User:
        user = self.request.user
        assert isinstance(user, User)
        return user

    def page(self, queryset: Any, serializer_class: Any, context: dict[str, Any] | None = None) -> Response:
        paginator = LimitOffsetPagination()
        rows: list[Any] | None = paginator.paginate_queryset(queryset, self.request, view=self)
        if context is None:
            return paginator.get_paginated_response(serializer_class(rows, many=True).data)
        return paginator.get_paginated_response(serializer_class(rows, many=True, context=context).data)


class ProviderView(Audited, APIView):
    """Every endpoint of the provider's Platform Management Center (the public domain): its admins only."""

    permission_classes = [ProviderAdmin]

    def tenant_or_404(self, slug: str) -> Tenant:
        tenant = tenants.tenant_get(slug=slug)
        if tenant is None:
            raise Http404
        return tenant
