"""Every change made through the API is audited: who, which endpoint, what object. Bodies are never
recorded (they may hold a secret or a password)."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.models import ApiToken, User
from apps.audit.middleware import record_after
from apps.audit.services import record


class Audited:
    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        user, method = getattr(request, "user", None), request.method or ""
        token = request.auth if isinstance(request.auth, ApiToken) else None
        if response.status_code == 403 and token is not None and token.agent:
            # A delegated token used beyond its scope: recorded by apps.audit.middleware once the
            # request's transaction (rolled back for the refusal) is over.
            detail = getattr(response, "data", None)
            record_after(
                request._request,
                actor=token.acting,
                on_behalf_of=token.user.username,
                action="token.refused",
                reason=str(detail.get("detail", "")) if isinstance(detail, dict) else "",
            )
        if method not in SAFE_METHODS and 200 <= response.status_code < 300 and isinstance(user, User):
            match = request.resolver_match
            action = f"{match.url_name if match is not None else 'api'}.{method.lower()}"
            acting = token.acting if token is not None else user.username  # "agent X for alice"
            on_behalf_of = user.username if acting != user.username else ""
            record(actor=acting, action=action, target=request.path, on_behalf_of=on_behalf_of)
        return response
