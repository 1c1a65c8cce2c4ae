"""Every change made through the API is audited: who, which endpoint, what object. Bodies are never
recorded (they may hold a secret or a password)."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.models import User
from apps.audit.services import record


class Audited:
    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[misc]
        user, method = getattr(request, "user", None), request.method or ""
        if method not in SAFE_METHODS and 200 <= response.status_code < 300 and isinstance(user, User):
            match = request.resolver_match
            action = f"{match.url_name if match is not None else 'api'}.{method.lower()}"
            record(actor=user.username, action=action, target=request.path)
        return response
