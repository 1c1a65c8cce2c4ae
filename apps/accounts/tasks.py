"""Background work of accounts. Each task takes a tenant's schema name first (see tenants.tenancy)."""

from __future__ import annotations

from apps.accounts import services
from tenants.models import Tenant
from tenants.tenancy import tenant_task


@tenant_task("accounts.token_purge_expired", autoretry_for=(ConnectionError,), max_retries=3)
def token_purge_expired(tenant: Tenant) -> int:
    """Delete the tenant's tokens that expired or were revoked over 30 days ago. Idempotent."""
    return services.token_purge_expired()
