"""The public index of API tokens: which tenant issued a token prefix, so a request that names no tenant
(the gateway's, an agent's, the CLI's) reaches the right schema. It holds each token's hash, never the
token; a lookup answers only someone holding the real token."""

from __future__ import annotations

import hmac

from django_tenants.utils import get_public_schema_name, schema_context

from tenants.models import Tenant, TokenRoute


def token_route_register(*, tenant: Tenant, prefix: str, secret_hash: str) -> None:
    with schema_context(get_public_schema_name()):
        TokenRoute.objects.create(prefix=prefix, tenant=tenant, secret_hash=secret_hash)


def token_route_forget(*, prefixes: list[str]) -> None:
    with schema_context(get_public_schema_name()):
        TokenRoute.objects.filter(prefix__in=prefixes).delete()


def token_route_tenant(*, prefix: str, secret_hash: str) -> Tenant | None:
    """The tenant that issued a token, only for someone holding the real token."""
    with schema_context(get_public_schema_name()):
        route = TokenRoute.objects.select_related("tenant").filter(prefix=prefix).first()
    if route is None or not hmac.compare_digest(route.secret_hash, secret_hash):
        return None
    return route.tenant
