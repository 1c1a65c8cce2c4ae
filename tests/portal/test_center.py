"""The Platform Management Center in real Chromium: the provider's admin sees every tenant with its usage,
creates one and suspends it; a tenant's admin cannot open it."""

from __future__ import annotations

from typing import Any

import pytest
from django_tenants.utils import get_public_schema_name, schema_context

from tests.gateway.conftest import committed
from tests.portal.conftest import PASSWORD, Portal, screenshot, sign_in, wait_for
from tests.portal.test_portal import UNLABELLED

pytestmark = pytest.mark.django_db


def provider_sign_in(page: Any, portal: Portal, username: str = "root") -> None:
    page.goto(f"{portal.provider}/portal/")
    assert "/portal/sign-in/" in page.url
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_label("Password").press("Enter")


def test_the_center_lists_every_tenant_with_usage_and_draws_it(page: Any, portal: Portal) -> None:
    from apps.scheduling.cycle import run_cycle
    from tenants.models import Tenant
    from tests.portal.test_portal import seed_a_busy_hour

    portal.run(seed_a_busy_hour)  # a 4-GPU task running in tenant portal
    portal.run(lambda: run_cycle(Tenant.objects.get(slug="portal")))  # each cycle publishes what is held
    provider_sign_in(page, portal)
    page.wait_for_url(f"{portal.provider}/portal/")
    listed = page.locator("tr[data-tenant]").evaluate_all("rows => rows.map(row => row.dataset.tenant)")
    assert {"acme", "globex", "portal"} <= set(listed)
    assert page.locator("tr[data-tenant='portal'] .in-use").inner_text() == "4.0"
    assert page.locator("tr[data-tenant='portal'] .apps").inner_text() == "0 / 0"  # running / all
    wait_for(page, "document.getElementById('usage-chart').chart !== undefined")
    series = page.evaluate("document.getElementById('usage-chart').chart.data.datasets.map(d => d.label)")
    assert "acme" in series  # acme's ledger has usage (the world's gateway call)
    assert page.evaluate(UNLABELLED) == []
    screenshot(page, "pmc")

    def finish_it() -> None:
        from apps.scheduling.lifecycle import transition
        from apps.scheduling.models import Task

        transition(Task.objects.get(name="idle-run"), to_state="completed", actor="agent")
        run_cycle(Tenant.objects.get(slug="portal"))

    portal.run(finish_it)
    page.evaluate("htmx.ajax('GET', '/portal/tenants/table/', '#tenants')")  # as its 30-second timer does
    page.locator("tr[data-tenant='portal'] .in-use").filter(has_text="0.0").wait_for()
    assert portal.errors == []


def test_the_provider_creates_suspends_and_resumes_a_tenant(page: Any, portal: Portal) -> None:
    provider_sign_in(page, portal)
    page.wait_for_url(f"{portal.provider}/portal/")
    try:
        page.get_by_label("Slug", exact=False).fill("pmc-made")
        page.get_by_label("Name", exact=True).fill("Made in the PMC")
        page.get_by_label("First admin's username").fill("mia")
        page.get_by_label("GPU share", exact=False).fill("4")
        page.get_by_role("button", name="Create tenant").click()
        page.get_by_role("status").filter(has_text="Tenant pmc-made is ready").wait_for()
        assert page.locator("pre.token").inner_text().startswith("klq_")
        row = page.locator("tr[data-tenant='pmc-made']")
        assert "4" in row.inner_text()
        row.get_by_label("Reason to suspend pmc-made").fill("invoice overdue")
        row.get_by_role("button", name="Suspend").click()
        page.locator("tr[data-tenant='pmc-made'] .state-suspended").wait_for()
        assert "invoice overdue" in page.locator("tr[data-tenant='pmc-made']").inner_text()
        screenshot(page, "pmc-suspended")
        page.locator("tr[data-tenant='pmc-made']").get_by_role("button", name="Resume pmc-made").click()
        page.locator("tr[data-tenant='pmc-made'] .state-active").wait_for()
        assert portal.errors == []
    finally:

        def delete() -> None:
            from apps.provider.services import tenant_delete
            from tenants.models import Tenant

            with schema_context(get_public_schema_name()):
                made = Tenant.objects.filter(slug="pmc-made").first()
                if made is not None:
                    tenant_delete(tenant=made)

        committed(portal.blocker, delete)


def test_a_tenant_admin_cannot_open_the_center(page: Any, portal: Portal) -> None:
    sign_in(page, portal)  # pat, admin of tenant portal
    page.goto(f"{portal.provider}/portal/")
    assert "/portal/sign-in/" in page.url  # a tenant's session is not a session here
    page.get_by_label("Username").fill("pat")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    alert = page.get_by_role("alert").inner_text()
    assert alert == "Wrong username or password, or not one of the provider's admins."
    assert page.locator("tr[data-tenant]").count() == 0
    page.goto(f"{portal.provider}/portal/tenants/table/")
    assert "/portal/sign-in/" in page.url
