"""Single sign-on in real Chromium: the portal's sign-in page sends the browser to a real OpenID Connect
provider (tests/oidc/provider.mjs), whose own login and consent pages are filled in, and back into the
portal, signed in with the role the provider's groups give; signing out ends the session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.portal.conftest import Portal, screenshot
from tests.sso.test_sso import CLIENT_ID, CLIENT_SECRET, start_provider

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def single_sign_on(portal: Portal) -> Iterator[str]:
    """The portal tenant signs in through a provider of its own; the provider's address."""
    url, process = start_provider(f"{portal.base}/auth/sso/callback/", f"{portal.base}/")

    def configure() -> None:
        from apps.accounts.models import Group, User
        from apps.sso.services import provider_save

        Group.objects.get_or_create(name="klique-admins")
        fields = {
            "issuer": url,
            "client_id": CLIENT_ID,
            "admin_groups": ["klique-admins"],
            "member_groups": ["researchers"],
        }
        provider_save(user=User.objects.get(username="pat"), fields=fields, client_secret=CLIENT_SECRET)

    try:
        portal.run(configure)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_person_signs_in_through_the_identity_provider_and_lands_in_the_portal(
    page: Any, portal: Portal, single_sign_on: str
) -> None:
    page.goto(f"{portal.base}/portal/queues/")
    assert "/portal/sign-in/" in page.url
    assert page.get_by_label("Password").count() == 0  # with SSO, passwords are for break-glass admins
    screenshot(page, "sign-in-sso")
    assert portal.errors == []
    failed: list[str] = []
    page.on("requestfailed", lambda request: failed.append(request.url))
    page.get_by_role("link", name="Sign in with single sign-on").click()
    page.wait_for_url(f"{single_sign_on}/**")  # the provider's own login page
    page.locator("input[name=login]").fill("admin-sam")
    page.locator("input[name=password]").fill("any")
    page.locator("button[type=submit]").click()
    page.locator("button[type=submit]").filter(has_text="Continue").click()  # its consent page
    page.wait_for_url(f"{portal.base}/portal/queues/")  # back where the person was going
    # The provider's development pages load a web font from the internet, which this machine cannot
    # reach: those failures are the provider's, and nothing of Klique's failed.
    assert [url for url in failed if not url.startswith("https://fonts.")] == []
    portal.errors.clear()
    assert page.locator(".who span").inner_text() == "admin-sam (admin)"  # the provider's group, a role
    assert page.get_by_role("link", name="Configuration").is_visible()
    screenshot(page, "signed-in-sso")

    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url(f"{portal.base}/portal/sign-in/")
    page.goto(f"{portal.base}/portal/")
    assert "/portal/sign-in/" in page.url  # the session ended
    assert portal.errors == []

    def signed_in_through_sso() -> tuple[str, bool]:
        from apps.accounts.models import User
        from apps.audit.models import AuditEvent

        sam = User.objects.get(username="admin-sam")
        return sam.role, AuditEvent.objects.filter(action="sso.signed_in", actor="admin-sam").exists()

    assert portal.run(signed_in_through_sso) == ("admin", True)
