"""The one shape every API error takes.

Every error body is `{"detail": "<a sentence saying what was wrong and what to do>"}`, plus `"errors"`
(field -> messages) for invalid input, so a person reading curl output and a program alike can act on it.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from apps.core.errors import KliqueError, error_lines


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, KliqueError):
        body: dict[str, Any] = {"detail": exc.message}
        if exc.errors is not None:
            body["errors"] = exc.errors
        elif exc.field:
            body["errors"] = {exc.field: [exc.message]}
        return Response(body, status=int(exc.status_code))
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("Not found. It may not exist, or it may belong to another tenant.")
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, exceptions.NotAuthenticated):
        # Reword in place: DRF has already attached the WWW-Authenticate challenge to this exception.
        exc.detail = exceptions.ErrorDetail(
            "No credentials were sent: add 'Authorization: Bearer <token>'. Create a token with "
            "POST /api/v1/tokens/ while signed in, or ask a tenant admin for one.",
            code="not_authenticated",
        )
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        lines = error_lines(exc.detail)
        response.data = {"detail": "Invalid input: " + "; ".join(lines), "errors": exc.detail}
    elif isinstance(response.data, dict) and "detail" in response.data:
        response.data = {"detail": str(response.data["detail"])}
    return response
