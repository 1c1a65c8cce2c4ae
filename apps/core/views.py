"""JSON answers for requests that reach no view, or whose view failed."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse

from apps.core.logging import request_id_var


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


def csrf_refused(request: HttpRequest, reason: str = "") -> JsonResponse:
    """CSRF_FAILURE_VIEW: a POST that did not come from Klique's own pages, said in a sentence."""
    return JsonResponse(
        {
            "detail": "Refused: this request did not come from Klique's own page (the CSRF check failed: "
            f"{reason or 'no token'}). Reload the page and send it again; scripts GET the address first "
            "for a token."
        },
        status=403,
    )
