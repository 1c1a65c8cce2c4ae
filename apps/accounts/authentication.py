"""DRF authentication by bearer token, in the schema of the request's tenant; and the read of the token's row
that rides in the round trip that finds the tenant (BearerRead)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from apps.accounts.models import ApiToken, User
from apps.accounts.services import (
    TokenRead,
    TokenRejected,
    token_authenticate,
    token_from_row,
    token_read_sql,
)
from apps.accounts.tokens import parse_prefix
from apps.audit.middleware import record_after
from apps.core.metrics import TOKEN_REJECTIONS
from tenants.selectors import Read


class BearerTokenAuthentication(BaseAuthentication):
    """`Authorization: Bearer klq_...`. The token row is read on every request, so revocation is immediate."""

    def authenticate(self, request: Request) -> tuple[User, ApiToken] | None:
        header = get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        tenant: Any = getattr(request, "tenant", None)
        if tenant is None:
            raise exceptions.AuthenticationFailed("This address serves no tenant, so no token is valid here.")
        read = getattr(request._request, "klique_token_read", None)
        try:
            return token_authenticate(tenant=tenant, presented=presented.strip(), read=read)
        except TokenRejected as rejected:
            TOKEN_REJECTIONS.labels(tenant.slug).inc()
            # Recorded by apps.audit.middleware once the request's transaction is over (only the
            # token's public prefix: never the token).
            prefix = parse_prefix(presented.strip())
            actor = f"klq_{prefix}" if prefix else "a malformed token"
            record_after(request._request, actor=actor, action="token.rejected", reason=str(rejected))
            raise exceptions.AuthenticationFailed(str(rejected)) from None

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="klique"'


def _presented_prefix(request: HttpRequest) -> str | None:
    scheme, _, presented = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    return parse_prefix(presented.strip()) if scheme.lower() == "bearer" else None


class BearerRead:
    """The token row of a request's `Authorization: Bearer klq_...`, read by tenants.middleware in the
    round trip that finds the tenant (settings.TENANT_ENTER_READ) instead of in one of its own.

    The row is read on every request, as before, only earlier: revocation is still immediate. What is
    decided of it (the secret's hash, revoked, expired, the user deactivated) is still decided by
    token_authenticate, when DRF authenticates the request."""

    @staticmethod
    def query(request: HttpRequest) -> tuple[Read, list[Any]] | None:
        prefix = _presented_prefix(request)
        return (token_read_sql, [prefix]) if prefix is not None else None

    @staticmethod
    def received(request: HttpRequest, row: tuple[Any, ...] | None) -> None:
        prefix = _presented_prefix(request)
        if prefix is not None:
            request.klique_token_read = TokenRead(prefix, token_from_row(row))  # type: ignore[attr-defined]
