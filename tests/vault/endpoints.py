"""The vault, audit and single sign-on endpoints, declared for the battery (tests/battery.py)."""

from __future__ import annotations

from tests.battery import Endpoint, fixed

ENDPOINTS = [
    Endpoint("GET", "api/v1/secrets/", "viewer", fixed("/api/v1/secrets/"), a_ids=lambda w: [w.secret_a]),
    Endpoint(
        "POST",
        "api/v1/secrets/",
        "member",
        fixed("/api/v1/secrets/"),
        body=lambda w: {"scope": "user", "name": "WANDB_API_KEY", "value": "abc123"},
        bad_body={"scope": "user", "name": "CUDA_VISIBLE_DEVICES", "value": "0"},
        expect=201,
    ),
    Endpoint(
        "GET",
        "api/v1/secrets/<uuid:secret_id>/",
        "viewer",
        lambda w: f"/api/v1/secrets/{w.secret_a}/",
        names_object=True,
    ),
    Endpoint(
        "PUT",
        "api/v1/secrets/<uuid:secret_id>/",
        "admin",
        lambda w: f"/api/v1/secrets/{w.secret_a}/",
        body=lambda w: {"value": "rotated"},
        bad_body={"value": "nul\u0000inside"},
        names_object=True,
    ),
    Endpoint(
        "DELETE",
        "api/v1/secrets/<uuid:secret_id>/",
        "admin",
        lambda w: f"/api/v1/secrets/{w.secret_a}/",
        names_object=True,
        expect=204,
    ),
    Endpoint("GET", "api/v1/audit/", "admin", fixed("/api/v1/audit/")),
    # The world's tenants have no single sign-on (tests/sso/ sets one up against a real provider), so
    # reading it says so, and a provider that does not answer is refused with the reason.
    Endpoint("GET", "api/v1/sso/", "admin", fixed("/api/v1/sso/"), expect=404),
    Endpoint(
        "PUT",
        "api/v1/sso/",
        "admin",
        fixed("/api/v1/sso/"),
        body=lambda w: {"issuer": "http://127.0.0.1:9/", "client_id": "klique", "client_secret": "x"},
        bad_body={"issuer": "not a url", "client_id": "klique"},
        expect=400,
    ),
]
