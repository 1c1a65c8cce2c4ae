"""Configure a tenant's single sign-on, and map an identity provider's claims to a Klique user."""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
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


# Access tokens from the tenant's identity provider, for resources such as the MCP server ---------------

ACCESS_TOKEN_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA")
KEYS_FOR_SECONDS = 300.0
_keys: dict[str, tuple[float, list[dict[str, Any]]]] = {}  # jwks_uri -> (read at, keys); per process


class AccessRefused(Exception):
    """An identity provider's access token that Klique does not take; the message says why."""


@dataclass(frozen=True)
class Access:
    user: User
    scopes: frozenset[str]
    subject: str


def provider_get() -> Provider | None:
    """The tenant's single sign-on provider, if it has one (in the current schema)."""
    return Provider.objects.filter(pk=1).first()


def access_token_user(*, provider: Provider, presented: str, resource: str) -> Access:
    """The Klique user an access token from the tenant's identity provider stands for, with the scopes
    it grants. The token must be a JWT (RFC 9068) signed by one of the provider's keys with an asymmetric
    algorithm, issued by its issuer for exactly this `resource` (its audience, RFC 8707: a token for
    another service is never taken here), unexpired, and name a person who has signed in to Klique
    before. Raises AccessRefused saying what was wrong."""
    try:
        header = jwt.get_unverified_header(presented)
    except jwt.InvalidTokenError:
        raise AccessRefused("The bearer token is neither a Klique token nor a JWT access token.") from None
    algorithm = header.get("alg")
    if algorithm not in ACCESS_TOKEN_ALGORITHMS:
        raise AccessRefused(f"Access tokens signed with {algorithm!r} are not taken; the provider must sign "
                            "them with an asymmetric key (RS256, ES256, ...).")  # fmt: skip
    key = signing_key(provider.jwks_uri, header).key
    try:
        claims: dict[str, Any] = jwt.decode(
            presented,
            key,
            algorithms=[algorithm],
            audience=resource,
            issuer=provider.issuer.rstrip("/"),
            leeway=30,
            options={"require": ["exp", "iss", "aud", "sub"]},
        )
    except jwt.InvalidAudienceError:
        raise AccessRefused(
            f"This access token is not for {resource}: ask the provider for one with resource={resource}."
        ) from None
    except jwt.InvalidIssuerError:
        raise AccessRefused(f"This access token was not issued by {provider.issuer}.") from None
    except jwt.ExpiredSignatureError:
        raise AccessRefused("This access token has expired: get a new one from the provider.") from None
    except jwt.InvalidTokenError as error:
        raise AccessRefused(f"This access token was refused: {error}.") from None
    username = claims.get(provider.username_claim)
    if not isinstance(username, str) or not username:
        raise AccessRefused(
            f"The access token carries no {provider.username_claim!r} claim naming the person; configure the "
            "provider to put it in access tokens."
        )
    user = User.objects.filter(username=username, kind=User.Kind.PERSON).first()
    if user is None or not user.is_active:
        raise AccessRefused(
            f"No active person {username!r} in this tenant: sign in to the portal through single sign-on "
            "once first, or ask a tenant admin to reactivate the account."
        )
    granted = claims.get("scope", "")
    scopes = frozenset(granted.split() if isinstance(granted, str) else [])
    return Access(user=user, scopes=scopes, subject=str(claims["sub"]))


def signing_key(jwks_uri: str, header: dict[str, Any]) -> jwt.PyJWK:
    """The provider's key that signed a token, by the token's key id and algorithm: from its JWKS, read at
    most every 5 minutes per process, and again at once for a key id it did not list (a rotation). Both
    the sign-in's ID tokens and the access tokens taken at /mcp are checked with it."""
    for fresh in (False, True):
        for key in _provider_keys(jwks_uri, fresh=fresh):
            if key.get("kid") == header.get("kid") and key.get("alg", header.get("alg")) == header.get("alg"):
                try:
                    return jwt.PyJWK(key)
                except jwt.PyJWKError as error:
                    raise AccessRefused(
                        f"The provider's key {key.get('kid')!r} is not usable: {error}."
                    ) from None
    raise AccessRefused("None of the identity provider's keys signed this token.")


def _provider_keys(jwks_uri: str, *, fresh: bool) -> list[dict[str, Any]]:
    read_at, keys = _keys.get(jwks_uri, (0.0, []))
    if not fresh and time.monotonic() - read_at < KEYS_FOR_SECONDS:
        return keys
    try:
        with outbound.client(timeout=10) as http:
            answer = http.get(jwks_uri)
        document = answer.json() if answer.status_code == 200 else {}
    except (httpx.HTTPError, outbound.OutboundRefused, ValueError) as error:
        raise AccessRefused(
            f"The identity provider's keys could not be read: {type(error).__name__}."
        ) from None
    found = document.get("keys") if isinstance(document, dict) else None
    keys = [key for key in found if isinstance(key, dict)] if isinstance(found, list) else []
    _keys[jwks_uri] = (time.monotonic(), keys)
    return keys
