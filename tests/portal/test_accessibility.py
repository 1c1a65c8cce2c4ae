"""Every portal page checked by axe-core (the accessibility engine browsers' own tools use), in Chromium:
no serious or critical violation (missing labels or names, contrast, landmarks, ARIA misuse)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.portal.conftest import PASSWORD, ROOT, Portal, sign_in

pytestmark = pytest.mark.django_db

AXE = ROOT / "frontend" / "node_modules" / "axe-core" / "axe.min.js"
PAGES = ["/portal/", "/portal/queues/", "/portal/dashboard/", "/portal/usage/", "/portal/tokens/",
         "/portal/agents/", "/portal/service-accounts/", "/portal/secrets/",
         "/portal/configuration/"]  # fmt: skip


def violations(page: Any) -> list[str]:
    page.evaluate(AXE.read_text())  # through DevTools, not a <script>: the pages' CSP runs no inline script
    found = page.evaluate(
        "async () => (await axe.run(document, {resultTypes: ['violations']})).violations"
        ".filter(v => ['serious', 'critical'].includes(v.impact))"
        ".map(v => `${v.id}: ${v.help} (${v.nodes.map(n => n.target.join(' ')).join(', ')})`)"
    )
    return list(found)


def test_the_tenant_pages_have_no_serious_accessibility_violations(page: Any, portal: Portal) -> None:
    page.goto(f"{portal.base}/portal/sign-in/")
    assert violations(page) == []
    sign_in(page, portal)
    for path in PAGES:
        page.goto(f"{portal.base}{path}")
        page.wait_for_load_state("networkidle")
        page.evaluate("document.querySelectorAll('details').forEach((item) => { item.open = true; })")
        assert violations(page) == [], path  # the configuration's forms included, each opened


def test_the_center_has_no_serious_accessibility_violations(page: Any, portal: Portal) -> None:
    page.goto(f"{portal.provider}/portal/")
    page.get_by_label("Username").fill("root")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_label("Password").press("Enter")
    page.wait_for_url(f"{portal.provider}/portal/")
    page.wait_for_load_state("networkidle")
    assert violations(page) == []
