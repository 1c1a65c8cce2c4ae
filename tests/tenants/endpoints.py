"""The tenant and provider APIs' endpoints, declared for the battery (tests/battery.py)."""

from __future__ import annotations

from tests.battery import Endpoint, fixed

ENDPOINTS = [
    Endpoint("GET", "api/v1/tenant/", "viewer", fixed("/api/v1/tenant/")),
    Endpoint("GET", "api/v1/provider/tenants/", "provider", fixed("/api/v1/provider/tenants/")),
    Endpoint("GET", "api/v1/provider/usage/", "provider", fixed("/api/v1/provider/usage/?by=day")),
    Endpoint(
        "POST",
        "api/v1/provider/tenants/",
        "provider",
        fixed("/api/v1/provider/tenants/"),
        body=lambda w: {"slug": "initech", "name": "Initech", "admin_username": "peter", "gpu_share": 8},
        bad_body={"slug": "Not A Slug!", "admin_username": "peter"},
        expect=201,
    ),
    Endpoint(
        "GET", "api/v1/provider/tenants/<slug:slug>/", "provider", fixed("/api/v1/provider/tenants/acme/")
    ),
    Endpoint(
        "PATCH",
        "api/v1/provider/tenants/<slug:slug>/",
        "provider",
        fixed("/api/v1/provider/tenants/acme/"),
        body=lambda w: {"gpu_share": 32},
        bad_body={"gpu_share": -1},
    ),
    Endpoint(
        "DELETE",
        "api/v1/provider/tenants/<slug:slug>/",
        "provider",
        fixed("/api/v1/provider/tenants/acme/"),
        expect=204,
    ),
    Endpoint(
        "POST",
        "api/v1/provider/tenants/<slug:slug>/suspend/",
        "provider",
        fixed("/api/v1/provider/tenants/acme/suspend/"),
        body=lambda w: {"reason": "The invoice for October is unpaid."},
        bad_body={"reason": ""},
    ),
    Endpoint(
        "POST",
        "api/v1/provider/tenants/<slug:slug>/resume/",
        "provider",
        fixed("/api/v1/provider/tenants/acme/resume/"),
    ),
]
