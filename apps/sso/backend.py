"""mozilla-django-oidc, configured per tenant: its settings come from the tenant's Provider row (set in
apps.sso.services.current for the request), users are made just in time from the claims."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import httpx
import jwt
from django.conf import settings
from django.core.exceptions import SuspiciousOperation
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from apps.accounts.models import User
from apps.core import outbound
from apps.sso import services
from apps.sso.models import Provider


def tenant_setting(attr: str, *default: Any) -> Any:
    configured = services.current.get()
    if configured is not None and attr in configured:
        return configured[attr]
    if hasattr(settings, attr) or not default:
        return getattr(settings, attr, "")
    return default[0]


class TenantOIDCBackend(OIDCAuthenticationBackend):
    get_settings = staticmethod(tenant_setting)

    @cached_property
    def provider(self) -> Provider:
        """The tenant's provider row, read once per sign-in (Django makes a backend per authenticate)."""
        return Provider.objects.get(pk=1)

    def authenticate(self, request: Any, **kwargs: Any) -> User | None:
        if services.current.get() is None:  # not a sign-in through this tenant's provider
            return None
        user: User | None = super().authenticate(request, **kwargs)
        return user

    def verify_token(self, token: str, **kwargs: Any) -> dict[str, Any]:
        """The library checks the signature (against the provider's keys), expiry and nonce; Klique also
        insists that the token was issued by this tenant's issuer, for this tenant's client."""
        try:
            payload: dict[str, Any] = super().verify_token(token, **kwargs)
        except jwt.InvalidTokenError as error:  # expired, not yet valid, malformed
            raise SuspiciousOperation(f"The ID token was refused: {error}.") from None
        provider = self.provider
        audience = payload.get("aud")
        audiences = audience if isinstance(audience, list) else [audience]
        if self.OIDC_RP_CLIENT_ID not in audiences:
            raise SuspiciousOperation(f"The ID token is for {audience!r}, not this tenant's client.")
        if str(payload.get("iss", "")).rstrip("/") != provider.issuer.rstrip("/"):
            raise SuspiciousOperation(
                f"The ID token was issued by {payload.get('iss')!r}, not {provider.issuer!r}."
            )
        return payload

    # The provider's endpoints are the tenant's to choose: every call to them goes through the guarded
    # client (apps.core.outbound), never mozilla-django-oidc's own requests calls, and a failure says what
    # failed without echoing what the endpoint answered.

    def _call(self, method: str, url: str, **options: Any) -> httpx.Response:
        try:
            with outbound.client(timeout=float(self.get_settings("OIDC_TIMEOUT", 10) or 10)) as http:
                response = http.request(method, url, **options)
        except httpx.HTTPError as error:
            raise SuspiciousOperation(f"The identity provider could not be reached: {error}") from None
        if response.status_code != 200:
            raise SuspiciousOperation(f"The identity provider answered {response.status_code} at {url}.")
        return response

    def retrieve_matching_jwk(self, token: str) -> Any:
        try:
            return services.signing_key(self.OIDC_OP_JWKS_ENDPOINT, jwt.get_unverified_header(token))
        except services.AccessRefused as refused:
            raise SuspiciousOperation(str(refused)) from None

    def get_token(self, payload: dict[str, Any]) -> Any:
        return self._call("POST", self.OIDC_OP_TOKEN_ENDPOINT, data=payload).json()

    def get_userinfo(self, access_token: str, id_token: str, payload: dict[str, Any]) -> Any:
        answer = self._call(
            "GET", self.OIDC_OP_USER_ENDPOINT, headers={"Authorization": f"Bearer {access_token}"}
        )
        if answer.headers.get("content-type", "").lower().startswith("application/jwt"):
            return self.verify_token(answer.text)
        return answer.json()

    def filter_users_by_claims(self, claims: dict[str, Any]) -> Any:
        provider = self.provider
        return User.objects.filter(username=claims.get(provider.username_claim, ""), kind=User.Kind.PERSON)

    def verify_claims(self, claims: dict[str, Any]) -> bool:
        return True  # user_from_claims checks the claims it needs and records a refusal

    def create_user(self, claims: dict[str, Any]) -> User | None:
        return services.user_from_claims(self.provider, claims)

    def update_user(self, user: User, claims: dict[str, Any]) -> User | None:
        return services.user_from_claims(self.provider, claims)
