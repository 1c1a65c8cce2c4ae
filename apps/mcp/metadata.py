"""The OAuth 2.0 protected-resource metadata of a tenant's `/mcp` (RFC 9728), which MCP clients read
to learn how to authenticate there."""

from __future__ import annotations

from typing import Any

from django_tenants.utils import schema_context

from apps.sso.services import provider_get
from tenants.selectors import tenant_for_host


def protected_resource(*, host: str, origin: str) -> tuple[int, dict[str, Any]]:
    """The metadata document for `/mcp` at `host`, with its HTTP status. `/mcp` takes the tenant's own
    Klique tokens (a person's, a service account's, an agent's delegated token) as bearer tokens. Where
    the tenant has single sign-on, it names the tenant's identity provider as its authorization server
    and takes the provider's access tokens issued for this resource (RFC 8707), with scopes read and
    submit; without it, it names none, since it takes no token another server issued."""
    tenant = tenant_for_host(host)
    if tenant is None or tenant.schema_name == "public":
        return 404, {"error": f"No tenant is served at {host!r}."}
    document: dict[str, Any] = {
        "resource": f"{origin}/mcp",
        "resource_name": f"Klique for {tenant.name}",
        "bearer_methods_supported": ["header"],
        "scopes_supported": ["read", "submit", "admin"],
        "resource_documentation": f"{origin}/api/docs/",
    }
    with schema_context(tenant.schema_name):
        provider = provider_get()
    if provider is not None:
        document["authorization_servers"] = [provider.issuer.rstrip("/")]
        document["scopes_supported"] = ["read", "submit"]  # what the provider's tokens may grant here
    return 200, document
