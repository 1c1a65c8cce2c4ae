"""Who an MCP request is: the tenant its address serves and the Klique token it presents (a person's, a
service account's, or an AI agent's delegated token), read in the tenant's schema like the REST API reads
it. Runs in a thread, off the event loop."""

from __future__ import annotations

from dataclasses import dataclass

from django_tenants.utils import schema_context

from apps.accounts.models import ApiToken, User
from apps.accounts.services import TokenRejected, token_authenticate
from apps.sso.models import Provider
from apps.sso.services import AccessRefused, access_token_user, provider_get
from tenants.models import Tenant
from tenants.selectors import tenant_for_host


class NotServed(Exception):
    """The request cannot be taken at all: `status` and the words to answer with."""

    def __init__(self, status: int, message: str, *, invalid_token: bool = False) -> None:
        super().__init__(message)
        self.status, self.invalid_token = status, invalid_token


@dataclass(frozen=True)
class Identity:
    """Who the request is, as authenticated for it: the tools act as this user through this token."""

    tenant: Tenant
    user: User
    token: ApiToken
    origin: str = ""  # the address the client used ("https://acme.klique.example"), for what names it


def identity_for(*, host: str, presented: str, origin: str = "") -> Identity:
    """The identity behind `presented` at `host`; raises NotServed saying why not. A Klique token is read
    as the REST API reads it; where the tenant has single sign-on, an access token its identity provider
    issued for this resource (`origin`/mcp) is taken too, as the person it names, with scope submit when
    it grants `submit` and read otherwise."""
    tenant = tenant_for_host(host)
    if tenant is None or tenant.schema_name == "public":
        raise NotServed(404, f"No tenant is served at {host!r}: use your tenant's own address, /mcp there.")
    if tenant.is_suspended:
        raise NotServed(403, f"Tenant {tenant.slug} is suspended: {tenant.suspended_reason}")
    if not presented:
        raise NotServed(
            401,
            "Send your Klique token as a bearer token ('Authorization: Bearer klq_...'); create one with "
            "POST /api/v1/tokens/, or a delegated token for an AI agent.",
        )
    with schema_context(tenant.schema_name):
        provider = None if presented.startswith("klq_") else provider_get()
        if provider is not None:
            return _from_provider(tenant, provider, presented, origin)
        try:
            user, token = token_authenticate(tenant=tenant, presented=presented)
        except TokenRejected as rejected:
            raise NotServed(401, str(rejected), invalid_token=True) from None
        return Identity(tenant=tenant, user=user, token=token, origin=origin)


def _from_provider(tenant: Tenant, provider: Provider, presented: str, origin: str) -> Identity:
    try:
        access = access_token_user(provider=provider, presented=presented, resource=f"{origin}/mcp")
    except AccessRefused as refused:
        raise NotServed(401, str(refused), invalid_token=True) from None
    scope = ApiToken.Scope.SUBMIT if "submit" in access.scopes else ApiToken.Scope.READ
    # Not stored: it stands for this one request, with the scope the provider granted.
    token = ApiToken(user=access.user, name="single sign-on", scope=scope, prefix="sso", agent="")
    return Identity(tenant=tenant, user=access.user, token=token, origin=origin)
