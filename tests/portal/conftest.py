"""The portal under test: a real `klique web` on the test database, a committed tenant "portal" whose
admin signs in with a password, and Debian's Chromium driven by Playwright (installed with apt-get when
missing, as root; never `playwright install`). Pages are reached at http://portal.klique.test:<port>/,
which Chromium resolves to 127.0.0.1. Screenshots go to test-artifacts/portal/."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from django_tenants.utils import schema_context
from playwright.sync_api import Error as PlaywrightError

from tests.e2e.conftest import free_port
from tests.gateway.conftest import committed, start_web, wait_until_listening

# Playwright's sync API keeps an event loop running in the test's thread, which Django takes for an async
# context: the test database's own setup and teardown in this thread are safe, so allow them.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "portal"
CHROMIUM = "/usr/bin/chromium"
PASSWORD = "correct horse battery staple"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--host-resolver-rules=MAP *.klique.test 127.0.0.1, MAP klique.test 127.0.0.1",
]


def ensure_chromium() -> str:
    if shutil.which("chromium") or Path(CHROMIUM).exists():
        return CHROMIUM
    if os.geteuid() != 0:
        pytest.skip("Chromium is not installed and installing it (apt-get) needs root.")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "chromium"], check=True, env=environment, capture_output=True
    )
    return CHROMIUM


@dataclass
class Portal:
    base: str
    blocker: Any
    provider: str = ""  # the Platform Management Center's address (the base domain)
    errors: list[str] = field(default_factory=list)

    def run(self, function: Any) -> Any:
        def in_schema() -> Any:
            with schema_context("portal"):
                return function()

        return committed(self.blocker, in_schema)


def _make_tenant() -> None:
    from django.utils import timezone
    from django_tenants.utils import get_public_schema_name

    from apps.accounts.models import User
    from apps.accounts.services import group_save
    from apps.configuration.services import draft_provision, draft_save
    from apps.provider.services import tenant_create
    from apps.resources.models import Pool
    from tests.scheduling.config import acme_document

    with schema_context(get_public_schema_name()):  # the provider's admin signs in to the PMC
        root = User.objects.get(username="root")
        root.set_password(PASSWORD)
        root.save()
    created = tenant_create(slug="portal", name="Portal Labs", admin_username="pat")
    with schema_context("portal"):
        pat = User.objects.get(username="pat")
        pat.set_password(PASSWORD)
        pat.save()
        group_save(tenant=created.tenant, name="research", members=[pat])
        group_save(tenant=created.tenant, name="dev", members=[pat])
        draft_save(tenant=created.tenant, user=pat, document=acme_document())
        draft_provision(tenant=created.tenant, user=pat)
        Pool.objects.update(last_heartbeat_at=timezone.now())


@pytest.fixture(scope="module")
def portal(django_db_blocker: Any, world: Any) -> Iterator[Portal]:
    from apps.provider.services import tenant_delete
    from tenants.models import Tenant

    committed(django_db_blocker, _make_tenant)
    port = free_port()
    web = start_web(port)
    try:
        wait_until_listening(port, web)
        yield Portal(f"http://portal.klique.test:{port}", django_db_blocker, f"http://klique.test:{port}")
    finally:
        web.terminate()
        web.wait(timeout=20)

        def delete() -> None:
            connections.close_all()
            tenant_delete(tenant=Tenant.objects.get(slug="portal"))

        committed(django_db_blocker, delete)


@contextlib.contextmanager
def chromium_launched() -> Iterator[Any]:
    """Debian's Chromium (installed if missing) launched under Playwright."""
    from playwright.sync_api import sync_playwright

    executable = ensure_chromium()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium_launched() as launched:
        yield launched
        # Database connections opened while Playwright's loop ran belong to that context (Django keeps
        # them per context there): close them here, or the test database could not be dropped.
        connections.close_all()


@pytest.fixture
def page(browser: Any, portal: Portal) -> Iterator[Any]:
    """A fresh browser page; console errors and page errors collected in portal.errors."""
    context = browser.new_context()
    opened = context.new_page()
    portal.errors = []
    opened.on(
        "console", lambda message: portal.errors.append(message.text) if message.type == "error" else None
    )
    opened.on("pageerror", lambda error: portal.errors.append(str(error)))
    yield opened
    context.close()


def screenshot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def wait_for(page: Any, expression: str, timeout: float = 30, **given: Any) -> None:
    """Wait until `expression` is true in the page. Playwright's wait_for_function evaluates its string
    with eval inside the page, which the portal's Content Security Policy forbids; page.evaluate goes
    through DevTools, which it does not.

    A live page swaps its parts in (htmx): an expression that meets an element in the middle of its swap
    (null for an instant) is not true yet, and is asked again."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        try:
            if page.evaluate(expression, given["arg"]) if "arg" in given else page.evaluate(expression):
                return
        except PlaywrightError as error:
            last_error = str(error).splitlines()[0]
        if time.monotonic() > deadline:
            said = f" (last: {last_error})" if last_error else ""
            raise AssertionError(f"{expression} did not become true within {timeout} s{said}")
        time.sleep(0.1)


def sign_in(page: Any, portal: Portal) -> None:
    page.goto(f"{portal.base}/portal/")
    page.get_by_label("Username").fill("pat")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_label("Password").press("Enter")  # by keyboard
    page.wait_for_url(f"{portal.base}/portal/")
