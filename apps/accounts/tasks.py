"""Background work of accounts. Each task takes a tenant's schema name first (see tenants.tenancy)."""

from __future__ import annotations

from apps.accounts import services
from tenants import due
from tenants.models import Tenant
from tenants.tenancy import tenant_task

due.predicate("token_purge")(services.tokens_to_purge)


@tenant_task(
    "accounts.token_purge_expired", settles="token_purge", autoretry_for=(ConnectionError,), max_retries=3
)
def token_purge_expired(tenant: Tenant) -> int:
    """Delete the tenant's tokens that expired or were revoked over 30 days ago. Idempotent."""
    return services.token_purge_expired()
