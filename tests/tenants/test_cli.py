"""The provider's command line (`klique tenant ...`, `klique provider-admin ...`)."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import User
from tenants.models import Tenant
from tests.world import World


def run(*arguments: str) -> str:
    out = io.StringIO()
    call_command(*arguments, stdout=out)
    return out.getvalue()


def test_create_list_suspend_resume_delete(world: World, db: None) -> None:
    created = run(
        "tenant", "create", "umbrella", "--name", "Umbrella", "--admin", "wesker", "--gpu-share", "12"
    )
    assert "Created tenant umbrella at umbrella.klique.test" in created
    token = created.split("Admin token (shown once): ")[1].strip()
    client = APIClient(HTTP_HOST="umbrella.klique.test", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert client.get("/api/v1/tenant/").json()["gpu_share"] == 12

    assert '"slug": "umbrella"' in run("tenant", "list")
    run("tenant", "suspend", "umbrella", "--reason", "Contract ended.")
    assert client.get("/api/v1/tenant/").status_code == 403
    run("tenant", "resume", "umbrella")
    assert client.get("/api/v1/tenant/").status_code == 200

    with pytest.raises(CommandError, match="pass --yes"):
        run("tenant", "delete", "umbrella")
    run("tenant", "delete", "umbrella", "--yes")
    assert not Tenant.objects.filter(slug="umbrella").exists()


def test_errors_are_sentences_not_tracebacks(world: World, db: None) -> None:
    with pytest.raises(CommandError, match="No tenant named 'nobody'"):
        run("tenant", "suspend", "nobody", "--reason", "x")
    with pytest.raises(CommandError, match="already exists"):
        run("tenant", "create", "acme", "--admin", "eve")
    with pytest.raises(CommandError, match="lowercase letters"):
        run("tenant", "create", "Bad_Slug", "--admin", "eve")


def test_provider_admin_is_made_in_the_public_schema_only(world: World, db: None) -> None:
    output = run("provider_admin", "ops")
    token = output.split("Token (shown once): ")[1].strip()
    with schema_context("public"):
        assert User.objects.get(username="ops").role == "admin"
    with schema_context("acme"):
        assert not User.objects.filter(username="ops").exists()
    provider = APIClient(HTTP_HOST="klique.test", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert provider.get("/api/v1/provider/tenants/").status_code == 200
    # Running it again issues a new token to the same admin.
    assert "Found provider admin ops" in run("provider_admin", "ops")
