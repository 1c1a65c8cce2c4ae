"""Request context (id, access log, metrics) and the probes that must answer whatever the Host header."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from apps.core.health import readiness
from apps.core.logging import request_id_var, tenant_var
from apps.core.metrics import HTTP_LATENCY, HTTP_REQUESTS

logger = logging.getLogger("klique.access")
# A caller's X-Request-ID is kept only if it is a sane token, so nobody can inject text into the logs.
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


class RequestContextMiddleware:
    """Give each request an id (the caller's X-Request-ID or a new one), log it once, and count it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        offered = request.headers.get("X-Request-ID", "")
        request_id = offered if _REQUEST_ID_RE.fullmatch(offered) else uuid.uuid4().hex
        request_marker = request_id_var.set(request_id)
        tenant_marker = tenant_var.set(None)
        started = time.perf_counter()
        try:
            response = self.get_response(request)
            elapsed = time.perf_counter() - started
            match = request.resolver_match
            route = match.route if match else ("probe" if request.path in PROBES else "unmatched")
            HTTP_REQUESTS.labels(request.method, route, str(response.status_code)).inc()
            HTTP_LATENCY.labels(request.method, route).observe(elapsed)
            response["X-Request-ID"] = request_id
            logger.info(
                "%s %s %s",
                request.method,
                request.path,
                response.status_code,
                extra={
                    "status": response.status_code,
                    "duration_ms": round(elapsed * 1000, 2),
                    "route": route,
                },
            )
            return response
        finally:
            tenant_var.reset(tenant_marker)
            request_id_var.reset(request_marker)


def healthz(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"status": "alive"})


def readyz(request: HttpRequest) -> HttpResponse:
    checks = readiness()
    ready = all(check.ok for check in checks)
    body = {
        "status": "ready" if ready else "not ready",
        "checks": {check.name: {"ok": check.ok, "detail": check.detail} for check in checks},
    }
    return JsonResponse(body, status=200 if ready else 503)


def metrics(request: HttpRequest) -> HttpResponse:
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)


PROBES: dict[str, Callable[[HttpRequest], HttpResponse]] = {
    "/healthz": healthz,
    "/readyz": readyz,
    "/metrics": metrics,
}


class ProbeMiddleware:
    """Answer liveness, readiness and metrics before tenant resolution: load balancers call by IP."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        probe = PROBES.get(request.path_info.rstrip("/") or "/")
        if probe is not None and request.method in {"GET", "HEAD"}:
            return probe(request)
        return self.get_response(request)


NUL_REFUSED = (
    "Text with NUL characters (\\x00, \\u0000) or unpaired surrogates (\\ud800) is not accepted anywhere "
    "in Klique's API: remove them and send the request again."
)
# What PostgreSQL's text and jsonb cannot hold: NUL, and UTF-16 surrogates that pair with nothing (JSON's
# "\ud800" escapes decode to them).
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def has_nul(value: object) -> bool:
    """Whether a parsed JSON value holds a NUL (or an unpaired surrogate) in any string, key or value,
    however deep."""
    if isinstance(value, str):
        return UNSTORABLE.search(value) is not None
    if isinstance(value, dict):
        return any(has_nul(key) or has_nul(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(has_nul(item) for item in value)
    return False


class RefuseNulMiddleware:
    """NULs are refused at the edge: PostgreSQL's text cannot hold them, so a NUL reaching a query or a
    row would be a 500 (or a value no later path can read). Query strings and form bodies are checked
    here; JSON bodies by apps.core.parsers.JSONParser, where they are parsed."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if "%00" in request.META.get("QUERY_STRING", "") or has_nul(dict(request.GET.lists())):
            return JsonResponse({"detail": NUL_REFUSED}, status=400)
        forms = ("application/x-www-form-urlencoded", "multipart/form-data")
        if request.method == "POST" and request.content_type in forms and has_nul(dict(request.POST.lists())):
            return JsonResponse({"detail": NUL_REFUSED}, status=400)
        return self.get_response(request)


PORTAL_CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "style-src-elem 'self'",  # style sheets only from Klique; style attributes (Chart.js sizes
        "style-src-attr 'unsafe-inline'",  # its canvases with them) cannot run script
        "img-src 'self' data:",
        "font-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)


class PortalContentSecurityPolicy:
    """The portal's and the Platform Management Center's pages run only Klique's own scripts and styles
    (no inline script, no eval) and are framed by no one; X-Frame-Options comes from Django's
    XFrameOptionsMiddleware for every answer. The API docs page (drf-spectacular's) is left as it is."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if request.path.startswith("/portal/"):
            response.headers.setdefault("Content-Security-Policy", PORTAL_CSP)
        return response
