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
GATEWAY_CALLS = Counter(
    "klique_gateway_calls_total",
    "LLM gateway calls, by tenant, model group and outcome (ok, cut, refused, failed).",
    ["tenant", "model", "status"],
)
GATEWAY_TOKENS = Counter(
    "klique_gateway_tokens_total", "Tokens through the LLM gateway, by tenant, model group and direction.",
    ["tenant", "model", "direction"],
)  # fmt: skip
GATEWAY_LATENCY = Histogram(
    "klique_gateway_call_duration_seconds",
    "Time from a gateway call's arrival to its last byte, by model group.",
    ["model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
