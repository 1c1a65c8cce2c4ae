"""The gateway under test: real `klique web` processes (uvicorn) on the test database, a local
OpenAI-compatible upstream (gateway.echo), and two committed tenants, gwa and gwb, with tokens and models.

The official `openai` client talks to it over HTTP, with the tenant's address in the Host header. Test
modules mark themselves `django_db` (so that the test database exists) and change the committed world
through `GatewayTenant.run`, which commits outside the test's own transaction."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings
from django.db import connections
from django_tenants.utils import schema_context

from apps.accounts.models import ApiToken, Role, User
from apps.accounts.services import (
    project_member_set,
    project_save,
    service_account_create,
    token_create,
    user_create,
)
from apps.provider.services import tenant_create, tenant_delete
from apps.vault.services import secret_set
from gateway import services
from gateway.cache import sync_redis
from tenants.models import Tenant
from tests.e2e.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ECHO_KEY = "sk-echo-upstream-key"


def wait_until_listening(port: int, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server on port {port} exited with {process.returncode}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listened on port {port} within {timeout} s")


def database_url() -> str:
    database = connections["default"].settings_dict
    password = f":{database['PASSWORD']}" if database.get("PASSWORD") else ""
    return f"postgres://{database['USER']}{password}@{database['HOST']}:{database['PORT']}/{database['NAME']}"


@pytest.fixture(scope="session")
def echo() -> Iterator[str]:
    """The upstream: gateway.echo on a free port; its base address."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.echo", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "ECHO_SLOW_SECONDS": "0.3", "ECHO_API_KEY": ECHO_KEY},
    )
    try:
        wait_until_listening(port, process)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=10)


def start_web(port: int) -> subprocess.Popen[bytes]:
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "PYTHONUNBUFFERED": "1",
    }
    argv = [sys.executable, "-m", "uvicorn", "config.asgi:application", "--port", str(port)]
    return subprocess.Popen([*argv, "--no-access-log", "--lifespan", "off"], cwd=ROOT, env=environment)


@pytest.fixture(scope="session")
def web(world: Any) -> Iterator[list[int]]:
    """Two gateway processes on the test database; their ports."""
    ports = [free_port(), free_port()]
    processes = [start_web(port) for port in ports]
    try:
        for port, process in zip(ports, processes, strict=True):
            wait_until_listening(port, process)
        yield ports
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=20)


def echo_document(echo: str, **extra: Any) -> dict[str, Any]:
    """Models "chat" (two deployments), "chat-backup", "broken" (always 500), "slow", "text", "embed"."""

    def deployment(name: str, model: str, **info: Any) -> dict[str, Any]:
        return {
            "model_name": name,
            "litellm_params": {"model": f"openai/{model}", "api_base": echo, "api_key_secret": "ECHO_KEY"},
            "model_info": {"input_cost_per_million": 1, "output_cost_per_million": 2, **info},
        }

    return {
        "model_list": [
            deployment("chat", "echo-a"),
            deployment("chat", "echo-b"),
            deployment("chat-backup", "echo-backup"),
            deployment("broken", "echo-fail"),
            deployment("slow", "echo-slow"),
            deployment("text", "echo", mode="completion"),
            deployment("embed", "echo", mode="embedding"),
        ],
        "router_settings": {"fallbacks": [{"broken": ["chat-backup"]}], "num_retries": 0},
        **extra,
    }


@dataclass
class GatewayTenant:
    slug: str
    host: str
    tokens: dict[str, str]  # persona -> bearer token
    project: str
    ports: list[int]
    blocker: Any
    user_ids: dict[str, str] = field(default_factory=dict)

    def client(self, persona: str = "ann", *, port_index: int = 0, **options: Any) -> openai.OpenAI:
        options.setdefault("api_key", self.tokens[persona])
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.ports[port_index]}/v1",
            default_headers={"Host": self.host},
            max_retries=0,
            **options,
        )

    def async_client(
        self, persona: str = "ann", *, port_index: int = 0, **options: Any
    ) -> openai.AsyncOpenAI:
        options.setdefault("api_key", self.tokens[persona])
        return openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.ports[port_index]}/v1",
            default_headers={"Host": self.host},
            max_retries=0,
            **options,
        )

    def run(self, function: Callable[[], Any]) -> Any:
        """Run `function` in this tenant's schema, committed (see `committed`)."""

        def in_schema() -> Any:
            with schema_context(self.slug):
                return function()

        return committed(self.blocker, in_schema)

    def configure(self, document: dict[str, Any]) -> None:
        self.run(lambda: services.settings_save(user=User.objects.get(username="ann"), document=document))

    def budget(self, **fields: Any) -> str:
        return str(self.run(lambda: services.budget_create(**fields).pk))

    def clear_budgets(self) -> None:
        from gateway.models import Budget

        def clear() -> None:
            for budget in Budget.objects.all():
                budget.delete()

        self.run(clear)

    def usage(self, **filters: Any) -> list[Any]:
        from gateway.models import Usage

        rows: list[Any] = self.run(lambda: list(Usage.objects.filter(**filters).order_by("at")))
        return rows


def committed(blocker: Any, function: Callable[[], Any]) -> Any:
    """Run `function` and commit it, whatever transaction the test is in: it runs in a thread of its own, on
    a connection of its own, so the gateway processes see what it did."""

    def run() -> Any:
        try:
            with blocker.unblock():
                return function()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def _clear_redis(slug: str) -> None:
    redis = sync_redis()
    for key in redis.scan_iter(f"kq:gw:{slug}:*"):
        redis.delete(key)


def _make_tenant(slug: str, echo: str, ports: list[int], blocker: Any) -> GatewayTenant:
    _clear_redis(slug)
    created = tenant_create(slug=slug, name=slug.upper(), admin_username="ann")
    tokens = {"ann": created.admin_token}
    with schema_context(slug):
        ann = User.objects.get(username="ann")
        secret_set(user=ann, scope="tenant", name="ECHO_KEY", value=ECHO_KEY)
        ben = user_create(tenant=created.tenant, username="ben", role=Role.MEMBER)
        vic = user_create(tenant=created.tenant, username="vic", role=Role.VIEWER)
        project = project_save(tenant=created.tenant, name="lab", admin=ann)
        project_member_set(tenant=created.tenant, project=project, user=ben, role=Role.MEMBER)
        tokens["ben"] = token_create(tenant=created.tenant, user=ben, name="gw").secret
        tokens["vic"] = token_create(tenant=created.tenant, user=vic, name="gw").secret
        tokens["ben-read"] = token_create(
            tenant=created.tenant, user=ben, name="r", scope=ApiToken.Scope.READ
        ).secret
        tokens["ben-agent"] = token_create(
            tenant=created.tenant, user=ben, name="a", scope=ApiToken.Scope.SUBMIT, agent="claude"
        ).secret
        robot = service_account_create(tenant=created.tenant, name="nightly-eval", description="evals")
        tokens["bot"] = token_create(tenant=created.tenant, user=robot, name="gw").secret
        services.settings_save(user=ann, document=echo_document(echo))
        ids = {"ann": str(ann.pk), "ben": str(ben.pk), "vic": str(vic.pk)}
    return GatewayTenant(slug, created.address, tokens, "lab", ports, blocker, ids)


@pytest.fixture(scope="module")
def gw(
    django_db_blocker: Any, world: Any, echo: str, web: list[int]
) -> Iterator[Callable[[str], GatewayTenant]]:
    """Committed tenants gwa and gwb (made on first use in a module, deleted after it)."""
    made: dict[str, GatewayTenant] = {}

    def tenant(slug: str) -> GatewayTenant:
        if slug not in made:
            made[slug] = committed(
                django_db_blocker, lambda: _make_tenant(slug, echo, web, django_db_blocker)
            )
        return made[slug]

    yield tenant

    def delete() -> None:
        for slug in made:
            tenant_delete(tenant=Tenant.objects.get(slug=slug))
            _clear_redis(slug)

    committed(django_db_blocker, delete)
