"""The OAuth 2.0 protected-resource metadata of a tenant's `/mcp` (RFC 9728), which MCP clients read
to learn how to authenticate there."""

from __future__ import annotations

from typing import Any

from tenants.selectors import tenant_for_host


def protected_resource(*, host: str, origin: str) -> tuple[int, dict[str, Any]]:
    """The metadata document for `/mcp` at `host`, with its HTTP status. `/mcp` takes the tenant's own
    Klique tokens (a person's, a service account's, an agent's delegated token) as bearer tokens; it names
    no authorization server, since it accepts no token another server issued."""
    tenant = tenant_for_host(host)
    if tenant is None or tenant.schema_name == "public":
        return 404, {"error": f"No tenant is served at {host!r}."}
    return 200, {
        "resource": f"{origin}/mcp",
        "resource_name": f"Klique for {tenant.name}",
        "bearer_methods_supported": ["header"],
        "scopes_supported": ["read", "submit", "admin"],
        "resource_documentation": f"{origin}/api/docs/",
    }
