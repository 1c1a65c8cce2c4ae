"""A committed tenant "fleet" for the agent protocol tests: consumers query from threads, so the rows
they read must be committed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.accounts.services import group_save
from apps.configuration.services import draft_provision, draft_save
from apps.fleet.credentials import agent_token_create
from apps.provider.services import tenant_create, tenant_delete
from apps.resources.models import Pool
from apps.scheduling.cycle import run_cycle
from apps.scheduling.services import TaskRequest, tasks_submit
from config.asgi import application
from tenants.models import Tenant
from tests.scheduling.config import acme_document
from tests.world import World

HOST = "fleet.klique.test"


@pytest.fixture
def fleet(django_db_blocker: pytest.FixtureRequest, world: World) -> Iterator[dict[str, Any]]:
    """A committed tenant with the test configuration, one placed task in h100 and an agent token."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        created = tenant_create(slug="fleet", name="Fleet", admin_username="fay")
        with schema_context("fleet"):
            fay = User.objects.get(username="fay")
            group_save(tenant=created.tenant, name="research", members=[fay])
            group_save(tenant=created.tenant, name="dev", members=[fay])
            document = acme_document()
            document["profiles"][0]["pools"] = [{"pool": "h100"}]
            draft_save(tenant=created.tenant, user=fay, document=document)
            draft_provision(tenant=created.tenant, user=fay)
            Pool.objects.update(last_heartbeat_at=timezone.now())
            (task,) = tasks_submit(
                tenant=created.tenant,
                user=fay,
                requests=[TaskRequest(compute_resource="Research: 4 GPUs", spec={"command": ["true"]})],
            )
            run_cycle(created.tenant)
            h100 = Pool.objects.get(name="h100")
            issued = agent_token_create(pool=h100, name="rack")
            other = agent_token_create(pool=Pool.objects.get(name="baremetal"), name="other")
        yield {
            "tenant": created.tenant,
            "task": str(task.pk),
            "token": issued,
            "other": other,
            "admin_token": created.admin_token,
        }
        connections.close_all()
        tenant_delete(tenant=Tenant.objects.get(slug="fleet"))


@pytest.fixture(autouse=True)
def _close_consumer_connections() -> Iterator[None]:
    """Consumers query from asgiref's long-lived worker thread; close its connection after each test."""
    yield
    asyncio.run(sync_to_async(connections.close_all)())


def agent(token: str) -> WebsocketCommunicator:
    return WebsocketCommunicator(
        application,
        "/agents/ws/",
        headers=[(b"host", HOST.encode()), (b"authorization", f"Bearer {token}".encode())],
    )


def in_fleet(function: Any) -> Any:
    def run() -> Any:
        try:
            with schema_context("fleet"):
                return function()
        finally:
            connections.close_all()

    return sync_to_async(run)()
