"""DRF authentication by bearer token, in the schema of the request's tenant."""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from apps.accounts.models import ApiToken, User
from apps.accounts.services import TokenRejected, token_authenticate
from apps.accounts.tokens import parse_prefix
from apps.audit.middleware import record_after
from apps.core.metrics import TOKEN_REJECTIONS


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
        try:
            return token_authenticate(tenant=tenant, presented=presented.strip())
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
