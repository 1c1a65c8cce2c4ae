"""JSON answers for requests that reach no view, or whose view failed."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse

from config.logging import request_id_var


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return JsonResponse(
        {"detail": f"Nothing is served at {request.path}. The API is listed at /api/docs/ on this address."},
        status=404,
    )


def server_error(request: HttpRequest) -> HttpResponse:
    return JsonResponse(
        {
            "detail": "Klique failed to answer this request, and none of its changes were kept. "
            f"Quote request id {request_id_var.get()} when reporting it."
        },
        status=500,
    )
