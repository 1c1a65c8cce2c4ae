"""The portal's middlewares, passed by the calls that cannot use them: an API call that authenticates by
its bearer token.

Sessions, CSRF cookies, Django's session user and flash messages serve the portal's pages (and the API
called from them, by session). A call under `/api/v1/` with `Authorization: Bearer ...` uses none of
them: DRF authenticates it by its token (apps.accounts.authentication, first of the API's
authenticators), which either names a user or refuses the call, so the session is never asked; every
view under `/api/v1/` is a DRF view, exempt from CSRF. Each of these middlewares still ran for such a call,
making a session store, a CSRF secret, a lazy user and two message stores that nothing read: together
about 55 µs of `GET /api/v1/me/`'s 830 in Django's handler here (bench/request_path.py).

So each runs here as Django's own, except for such a call, which goes straight on to the next one. What
the call is answered is the same (tests/core/test_portal_middleware.py compares both ways, header by
header), and CSRF's view check, which the handler runs apart from these calls, is not touched. The
SecurityMiddleware's headers, CommonMiddleware's and the frame and content policies apply to every call.
"""

from __future__ import annotations

from collections.abc import Awaitable

from django.contrib.auth.middleware import AuthenticationMiddleware
from django.contrib.messages.middleware import MessageMiddleware
from django.contrib.sessions.middleware import SessionMiddleware
from django.http import HttpRequest, HttpResponseBase
from django.middleware.csrf import CsrfViewMiddleware
from django.utils.deprecation import MiddlewareMixin

API_PREFIX = "/api/v1/"


def bearer_api_call(request: HttpRequest) -> bool:
    """Whether `request` is an API call that authenticates by its bearer token (whatever the token's worth:
    a bad one is refused by DRF, never by a session)."""
    return (
        request.path_info.startswith(API_PREFIX)
        and request.META.get("HTTP_AUTHORIZATION", "")[:7].lower() == "bearer "
    )


class PortalOnly(MiddlewareMixin):
    """Mixed in ahead of a portal middleware: Django's own behaviour, passed for a bearer API call."""

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        # (An awaitable where Django's handler runs the chain in async mode, as its own ASGI handler does.)
        if bearer_api_call(request):
            return self.get_response(request)
        return super().__call__(request)


class PortalSessionMiddleware(PortalOnly, SessionMiddleware):
    pass


class PortalCsrfMiddleware(PortalOnly, CsrfViewMiddleware):
    """Passes only the call's cookie handling (process_request, process_response); the handler still runs
    its view check (process_view) for every call, and DRF's views are exempt from it."""


class PortalAuthenticationMiddleware(PortalOnly, AuthenticationMiddleware):
    pass


class PortalMessageMiddleware(PortalOnly, MessageMiddleware):
    pass
