"""Liveness, readiness, metrics, request ids and JSON logs."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable

import pytest
from django.test import override_settings
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.core.logging import JsonFormatter
from tests.world import World


@pytest.mark.parametrize("host", ["acme.klique.test", "klique.test", "10.0.0.7", "unknown.example"])
def test_probes_answer_whatever_the_host(db: None, host: str) -> None:
    client = APIClient(HTTP_HOST=host)
    assert client.get("/healthz").json() == {"status": "alive"}
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.content
    assert ready.json()["checks"]["migrations"]["ok"] is True


def test_readiness_names_the_service_that_is_down(db: None) -> None:
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
        response = APIClient().get("/readyz")
    assert response.status_code == 503
    checks = response.json()["checks"]
    assert checks["database"]["ok"] is True
    assert checks["redis"]["ok"] is False
    assert "REDIS_URL" in checks["redis"]["detail"]


def test_metrics_count_requests_by_route(api: Callable[..., APIClient], world: World) -> None:
    api("alice").get(f"/api/v1/projects/{world.project_a}/")
    text = APIClient().get("/metrics").content.decode()
    assert (
        'klique_http_requests_total{method="GET",route="api/v1/projects/<uuid:project_id>/",status="200"}'
        in text
    )
    assert "klique_http_request_duration_seconds_bucket" in text


def test_request_id_is_kept_or_made(api: Callable[..., APIClient], world: World) -> None:
    kept = api("alice").get("/api/v1/me/", HTTP_X_REQUEST_ID="trace-123")
    assert kept["X-Request-ID"] == "trace-123"
    injected = api("alice").get("/api/v1/me/", HTTP_X_REQUEST_ID="bad id\nforged log line")
    assert injected["X-Request-ID"] != "bad id\nforged log line"
    assert len(injected["X-Request-ID"]) == 32


def test_access_log_is_json_with_request_id_and_tenant(api: Callable[..., APIClient], world: World) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    access_logger = logging.getLogger("klique.access")
    access_logger.addHandler(handler)
    try:
        api("alice").get("/api/v1/me/", HTTP_X_REQUEST_ID="req-42")
    finally:
        access_logger.removeHandler(handler)
    line = json.loads(stream.getvalue().splitlines()[-1])
    assert line["message"] == "GET /api/v1/me/ 200"
    assert (line["request_id"], line["tenant"]) == ("req-42", "acme")
    assert (line["status"], line["route"]) == (200, "api/v1/me/")
    assert isinstance(line["duration_ms"], float)
    # Tokens never reach the log, not even their prefix.
    assert "klq_" not in stream.getvalue()


def test_openapi_schema_and_docs_are_served(db: None, world: World) -> None:
    tenant_schema = APIClient(HTTP_HOST="acme.klique.test").get("/api/schema/?format=json")
    assert tenant_schema.status_code == 200
    paths = json.loads(tenant_schema.content)["paths"]
    assert "/api/v1/projects/{project_id}/members/" in paths
    assert not any(path.startswith("/api/v1/provider/") for path in paths)
    provider_schema = json.loads(APIClient(HTTP_HOST="klique.test").get("/api/schema/?format=json").content)
    assert "/api/v1/provider/tenants/" in provider_schema["paths"]
    docs = APIClient(HTTP_HOST="acme.klique.test").get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger-ui" in docs.content


def test_unknown_paths_and_missing_credentials_are_explained(
    api: Callable[..., APIClient], world: World
) -> None:
    missing = api("alice").get("/api/v1/no-such-thing/")
    assert missing.status_code == 404
    assert "/api/docs/" in missing.json()["detail"]
    anonymous = api(None).get("/api/v1/me/")
    assert anonymous.status_code == 401
    assert "Authorization: Bearer" in anonymous.json()["detail"]


def test_a_failing_view_answers_json_with_the_request_id(world: World, db: None) -> None:
    from apps.core.logging import request_id_var
    from apps.core.views import server_error

    marker = request_id_var.set("req-500")
    try:
        response = server_error(APIClient().get("/healthz").wsgi_request)
    finally:
        request_id_var.reset(marker)
    assert response.status_code == 500
    assert "req-500" in json.loads(response.content)["detail"]


def test_a_request_that_fails_midway_keeps_none_of_its_writes(
    api: Callable[..., APIClient], world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Project creation writes the project, then the creator's membership; a failure in the second
    write must not leave a project without an admin."""
    from apps.accounts.models import Project, ProjectMembership

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("membership table unavailable")

    monkeypatch.setattr(ProjectMembership.objects, "create", fail)
    client = api("alice")
    client.raise_request_exception = False
    response = client.post("/api/v1/projects/", {"name": "half-made"}, format="json")
    assert response.status_code == 500
    assert "none of its changes were kept" in response.json()["detail"]
    with schema_context("acme"):
        assert not Project.objects.filter(name="half-made").exists()
