"""Configure a tenant's single sign-on, and map an identity provider's claims to a Klique user."""

from __future__ import annotations

import contextvars
from typing import Any

import httpx
from django.contrib import auth
from django.db import transaction

from apps.accounts.models import Group, Role, User
from apps.accounts.services import sign_in_check, sign_in_failed, sign_in_succeeded
from apps.audit.services import record
from apps.core import outbound
from apps.core.errors import InvalidInput
from apps.sso.models import Provider
from apps.vault.models import Secret
from apps.vault.services import secret_set, tenant_secret

CLIENT_SECRET_NAME = "SSO_CLIENT_SECRET"  # noqa: S105 -- the vault name it is kept under, not a secret

# The OIDC settings of the tenant serving the current request (mozilla-django-oidc reads settings).
current: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("sso", default=None)


def discover(issuer: str) -> dict[str, Any]:
    """The provider's metadata, checked: it must name the same issuer and the endpoints Klique uses."""
    address = issuer.rstrip("/") + "/.well-known/openid-configuration"
    try:
        with outbound.client(follow_redirects=True) as http:  # each redirect's address is checked too
            response = http.get(address)
    except outbound.OutboundRefused as refused:
        raise InvalidInput(str(refused), field="issuer") from None
    except httpx.HTTPError as error:
        raise InvalidInput(
            f"The issuer's metadata could not be read at {address}: {type(error).__name__}.", field="issuer"
        ) from None
    if response.status_code != 200:
        raise InvalidInput(
            f"The issuer's metadata could not be read at {address}: it answered {response.status_code}.",
            field="issuer",
        )
    try:
        metadata: Any = response.json()
    except ValueError:
        metadata = None
    if not isinstance(metadata, dict):
        raise InvalidInput(f"{address} does not answer OpenID Connect metadata (JSON).", field="issuer")
    if metadata.get("issuer", "").rstrip("/") != issuer.rstrip("/"):
        raise InvalidInput(
            f"Wrong issuer: {address} says it is {metadata.get('issuer')!r}, not {issuer!r}.", field="issuer"
        )
    missing = [
        key
        for key in ("authorization_endpoint", "token_endpoint", "userinfo_endpoint", "jwks_uri")
        if not metadata.get(key)
    ]
    if missing:
        raise InvalidInput(f"The issuer's metadata lacks {', '.join(missing)}.", field="issuer")
    for key in ("token_endpoint", "userinfo_endpoint", "jwks_uri"):  # the ones the plane itself calls
        try:
            outbound.check_url(str(metadata[key]))
        except outbound.OutboundRefused as refused:
            raise InvalidInput(f"The issuer's {key}: {refused}", field="issuer") from None
    return metadata


@transaction.atomic
def provider_save(*, user: User, fields: dict[str, Any], client_secret: str | None) -> Provider:
    metadata = discover(fields["issuer"])
    if client_secret is not None:
        secret_set(user=user, scope=Secret.Scope.TENANT, name=CLIENT_SECRET_NAME, value=client_secret)
    elif not Secret.objects.filter(scope=Secret.Scope.TENANT, name=CLIENT_SECRET_NAME).exists():
        raise InvalidInput("Give the client's secret once; it is kept in the vault.", field="client_secret")
    endpoints = {
        key: metadata.get(key, "")
        for key in (
            "authorization_endpoint",
            "token_endpoint",
            "userinfo_endpoint",
            "jwks_uri",
            "end_session_endpoint",
        )
    }
    provider, _ = Provider.objects.update_or_create(pk=1, defaults={**fields, **endpoints})
    return provider


def oidc_settings(provider: Provider, *, with_secret: bool) -> dict[str, Any]:
    """mozilla-django-oidc's settings for this tenant. Only the callback, which redeems the code, needs
    the client secret: it is read (and the read audited) there alone."""
    secret = tenant_secret(CLIENT_SECRET_NAME, reader="single sign-on") if with_secret else ""
    return {
        "OIDC_RP_CLIENT_ID": provider.client_id,
        "OIDC_RP_CLIENT_SECRET": secret,
        "OIDC_OP_AUTHORIZATION_ENDPOINT": provider.authorization_endpoint,
        "OIDC_OP_TOKEN_ENDPOINT": provider.token_endpoint,
        "OIDC_OP_USER_ENDPOINT": provider.userinfo_endpoint,
        "OIDC_OP_JWKS_ENDPOINT": provider.jwks_uri,
        "OIDC_RP_SIGN_ALGO": "RS256",
        "OIDC_RP_SCOPES": "openid email profile groups",
        "OIDC_USE_PKCE": True,
    }


def role_from(provider: Provider, groups: list[str]) -> str:
    if set(groups) & set(provider.admin_groups):
        return Role.ADMIN
    if set(groups) & set(provider.member_groups):
        return Role.MEMBER
    return Role.VIEWER


def user_from_claims(provider: Provider, claims: dict[str, Any]) -> User | None:
    """Just-in-time: the user the claims name, created or updated with the role and groups they carry.
    None (and an audit record) when a claim Klique needs is missing."""
    username = claims.get(provider.username_claim)
    groups = claims.get(provider.groups_claim, [])
    if not isinstance(username, str) or not username or not isinstance(groups, list):
        record(
            actor="single sign-on",
            action="sso.refused",
            target=f"claims of {claims.get('sub', '?')}",
            reason=f"the {provider.username_claim!r} claim (a name) or the {provider.groups_claim!r} claim "
            "(a list) is missing",
        )
        return None
    role = role_from(provider, [str(group) for group in groups])
    user, created = User.objects.get_or_create(
        username=username[:150], defaults={"email": str(claims.get("email", "")), "role": role}
    )
    if not created and (user.role != role or (claims.get("email") and user.email != claims["email"])):
        user.role, user.email = role, str(claims.get("email") or user.email)
        user.save(update_fields=["role", "email"])
    for group in Group.objects.all():
        if group.name in groups:
            group.members.add(user)
        else:
            group.members.remove(user)
    record(
        actor=user.username,
        action="sso.signed_in",
        target=f"user {user.username}",
        role=role,
        created=created,
    )
    return user


class SignInRefused(Exception):
    pass


def password_sign_in(request: Any, username: str, password: str) -> User:
    """Break-glass password sign-in into a session: only a tenant admin, and only where the tenant allows
    it or has no single sign-on. Refusals are audited."""

    provider = Provider.objects.filter(pk=1).first()
    if provider is not None and not provider.break_glass_passwords:
        raise SignInRefused("This tenant signs in through single sign-on: use the single sign-on button.")
    sign_in_check(request=request, username=username, where="sign-in")  # SignInLimited past the limits
    user = auth.authenticate(request, username=username, password=password)
    if not isinstance(user, User) or (provider is not None and not user.has_role(Role.ADMIN)):
        sign_in_failed(request=request, username=username)
        record(actor=username[:150] or "?", action="password.refused", target="sign-in")
        raise SignInRefused("Wrong username or password, or not a break-glass admin.")
    sign_in_succeeded(username=user.username)
    auth.login(request, user, backend="django.contrib.auth.backends.ModelBackend")
    record(actor=user.username, action="password.signed_in", target="session")
    return user
