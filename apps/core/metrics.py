"""Prometheus metrics of the web process, served at /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

HTTP_REQUESTS = Counter(
    "klique_http_requests_total", "HTTP requests served, by route and status.", ["method", "route", "status"]
)
HTTP_LATENCY = Histogram(
    "klique_http_request_duration_seconds", "Time to serve an HTTP request, by route.", ["method", "route"]
)
TOKEN_REJECTIONS = Counter("klique_token_rejections_total", "Bearer tokens refused, by tenant.", ["tenant"])
