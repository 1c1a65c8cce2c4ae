"""Sign in through the tenant's identity provider, sign out, and break-glass password sign-in."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import httpx
import requests
from django.contrib import auth
from django.core.exceptions import SuspiciousOperation
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.middleware.csrf import get_token
from django.views.decorators.csrf import csrf_protect
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from apps.accounts.services import SignInLimited
from apps.audit.services import record
from apps.sso import services
from apps.sso.backend import tenant_setting
from apps.sso.models import Provider
from apps.sso.services import SignInRefused


def _configured(*, with_secret: bool) -> Provider | None:
    """The tenant's provider, its settings made current for mozilla-django-oidc; None without one."""
    provider = Provider.objects.filter(pk=1).first()
    if provider is not None:
        services.current.set(services.oidc_settings(provider, with_secret=with_secret))
    return provider


NOT_CONFIGURED = "This tenant has no single sign-on; a tenant admin sets it up with PUT /api/v1/sso/."


class SignIn(OIDCAuthenticationRequestView):
    get_settings = staticmethod(tenant_setting)

    def get(self, request: HttpRequest) -> HttpResponse:
        if _configured(with_secret=False) is None:
            return JsonResponse({"detail": NOT_CONFIGURED}, status=404)
        self.OIDC_OP_AUTH_ENDPOINT = tenant_setting("OIDC_OP_AUTHORIZATION_ENDPOINT")
        self.OIDC_RP_CLIENT_ID = tenant_setting("OIDC_RP_CLIENT_ID")
        response: HttpResponse = super().get(request)
        return response


class Callback(OIDCAuthenticationCallbackView):
    get_settings = staticmethod(tenant_setting)

    def get(self, request: HttpRequest) -> HttpResponse:
        if _configured(with_secret=True) is None:
            return JsonResponse({"detail": NOT_CONFIGURED}, status=404)
        try:
            response: HttpResponse = super().get(request)
        except (requests.RequestException, httpx.HTTPError, SuspiciousOperation, ValueError):
            # a code, state or token that fails, an endpoint that cannot be reached or answers nonsense
            return self.login_failure()
        return response

    def login_failure(self) -> HttpResponse:
        record(
            actor="single sign-on",
            action="sso.refused",
            target="sign-in",
            reason="the provider's answer did not verify",
        )
        why = "Sign-in failed: the identity provider's answer did not verify."
        return JsonResponse({"detail": f"{why} Start again at /auth/sso/login/."}, status=401)


@csrf_protect
def sign_out(request: HttpRequest) -> HttpResponse:
    """End the Klique session, then the provider's (RP-initiated logout) where it offers one. A POST from
    another site is refused (CSRF): it must carry the csrftoken cookie's value."""
    if request.method == "GET":
        return _csrf_instructions(request, "Sign out")
    if request.method != "POST":
        return JsonResponse({"detail": "Sign out with POST."}, status=405)
    provider = Provider.objects.filter(pk=1).first()
    id_token = request.session.get("oidc_id_token")
    if request.user.is_authenticated:
        record(actor=request.user.get_username(), action="sso.signed_out", target="session")
    auth.logout(request)
    if provider is not None and provider.end_session_endpoint:
        query: dict[str, Any] = {"client_id": provider.client_id}
        if id_token:
            query["id_token_hint"] = id_token
        return HttpResponseRedirect(f"{provider.end_session_endpoint}?{urlencode(query)}")
    return JsonResponse({"detail": "Signed out."})


def _csrf_instructions(request: HttpRequest, what: str) -> HttpResponse:
    """GET: how to POST here, with a CSRF token (the cookie is set with the answer)."""
    return JsonResponse(
        {
            "detail": f"{what} with POST, sending the csrftoken cookie set with this answer and its value as "
            "the X-CSRFToken header (or the csrfmiddlewaretoken field); a page of another site cannot.",
            "csrf_token": get_token(request),
        }
    )


@csrf_protect
def password_sign_in(request: HttpRequest) -> HttpResponse:
    """Break-glass: a tenant admin's password, only where the tenant allows it or has no SSO. CSRF is
    enforced (a login form on another site must not sign a visitor in as someone else), and attempts are
    limited per account and per address (apps.accounts.services.sign_in_check)."""
    if request.method == "GET":
        return _csrf_instructions(request, "Sign in (username and password)")
    if request.method != "POST":
        return JsonResponse({"detail": "Sign in with POST username and password."}, status=405)

    provider = Provider.objects.filter(pk=1).first()
    if provider is not None and not provider.break_glass_passwords:
        return JsonResponse(
            {"detail": "This tenant signs in through single sign-on: /auth/sso/login/."}, status=403
        )
    try:
        user = services.password_sign_in(
            request, request.POST.get("username", ""), request.POST.get("password", "")
        )
    except SignInRefused as refused:
        return JsonResponse({"detail": str(refused)}, status=401)
    except SignInLimited as limited:
        return JsonResponse({"detail": str(limited)}, status=429)
    return JsonResponse({"detail": f"Signed in as {user.username}."})
