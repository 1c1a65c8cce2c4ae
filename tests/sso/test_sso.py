"""Single sign-on end to end against a real OpenID Connect provider (node-oidc-provider, tests/oidc/),
driven as a browser would: Klique's sign-in redirect, the provider's login and consent pages, Klique's
callback, the session, sign-out."""

from __future__ import annotations

import base64
import datetime
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import httpx
import jwt
import pytest
from django.core.exceptions import SuspiciousOperation
from django.test import Client
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import Group, User
from apps.audit.models import AuditEvent
from apps.sso import services
from apps.sso.backend import TenantOIDCBackend
from apps.sso.models import Provider
from tests.e2e.conftest import free_port
from tests.world import HOST_A, World

pytestmark = pytest.mark.django_db

HERE = Path(__file__).resolve().parents[1] / "oidc"
CLIENT_ID, CLIENT_SECRET = "klique-acme", "acme-client-secret-value"
CALLBACK = f"http://{HOST_A}/auth/sso/callback/"


def start_provider(callback: str, after_sign_out: str) -> tuple[str, subprocess.Popen[str]]:
    """A running identity provider (tests/oidc/provider.mjs) whose one client is Klique's, sending the
    browser back to `callback`: its address and its process."""
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed; the SSO tests need it to run the identity provider")
    if not (HERE / "node_modules" / "oidc-provider").exists():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=HERE, check=True, timeout=300
        )
    port = free_port()
    process = subprocess.Popen(
        ["node", "provider.mjs", str(port), CLIENT_ID, CLIENT_SECRET, callback, after_sign_out],
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/.well-known/openid-configuration", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        process.kill()
        raise AssertionError(f"the identity provider did not start: {process.communicate()[0]}")
    return url, process


@pytest.fixture(scope="session")
def provider_url() -> Iterator[str]:
    url, process = start_provider(CALLBACK, f"http://{HOST_A}/")
    yield url
    process.terminate()
    process.wait(timeout=10)


def configure(api: Callable[..., APIClient], issuer: str, **overrides: object) -> dict[str, object]:
    body = {
        "issuer": issuer,
        "client_id": CLIENT_ID,
        "client_secret": CLIENT_SECRET,
        "admin_groups": ["klique-admins"],
        "member_groups": ["researchers"],
        **overrides,
    }
    response = api("alice").put("/api/v1/sso/", body, format="json")
    assert response.status_code == 200, response.content
    answer: dict[str, object] = response.json()
    return answer


def through_the_provider(start: str, login: str) -> str:
    """Log in at the provider's own pages and consent, as a person would; the callback address it sends
    the browser back to."""
    browser = httpx.Client(timeout=10)
    address = start
    for _ in range(12):
        response = browser.get(address) if not address.startswith("POST ") else None
        if response is None:
            raise AssertionError("unreachable")
        if response.is_redirect:
            address = urljoin(address, response.headers["location"])
            if address.startswith(CALLBACK):
                return address
            continue
        form = re.search(r'<form[^>]*action="([^"]+)"', response.text)
        assert form, response.text[:500]
        fields = dict(re.findall(r'<input[^>]*name="([^"]+)"[^>]*value="([^"]*)"', response.text))
        if 'name="login"' in response.text:
            fields.update(login=login, password="any")
        posted = browser.post(urljoin(address, form.group(1)), data=fields)
        assert posted.is_redirect, posted.text[:500]
        address = urljoin(address, posted.headers["location"])
        if address.startswith(CALLBACK):
            return address
    raise AssertionError("the provider never sent the browser back")


def sign_in(client: Client, login: str) -> str:
    started = client.get("/auth/sso/login/")
    assert started.status_code == 302, started.content
    return through_the_provider(started["Location"], login)


def test_sign_in_with_a_role_from_the_group_claim_then_sign_out(
    api: Callable[..., APIClient], world: World, provider_url: str
) -> None:
    shown = configure(api, provider_url)
    assert "client_secret" not in shown
    with schema_context("acme"):
        Group.objects.create(name="klique-admins")
    browser = Client(HTTP_HOST=HOST_A)
    back = sign_in(browser, "admin-jane")
    landed = browser.get(back.removeprefix(f"http://{HOST_A}"))
    assert landed.status_code == 302, landed.content
    assert landed["Location"] == "/portal/"  # single sign-on lands in the portal
    me = browser.get("/api/v1/me/")
    assert me.status_code == 200, me.content
    assert (me.json()["username"], me.json()["role"]) == ("admin-jane", "admin")
    with schema_context("acme"):
        jane = User.objects.get(username="admin-jane")
        assert jane.email == "admin-jane@example.com"
        assert list(jane.klique_groups.values_list("name", flat=True)) == ["klique-admins"]
        assert AuditEvent.objects.filter(action="sso.signed_in", actor="admin-jane").exists()

    signed_out = browser.post("/auth/logout/")
    assert signed_out.status_code == 302
    assert signed_out["Location"].startswith(f"{provider_url}/session/end?client_id={CLIENT_ID}")
    assert browser.get("/api/v1/me/").status_code in (401, 403)

    member = Client(HTTP_HOST=HOST_A)
    member.get(sign_in(member, "sam").removeprefix(f"http://{HOST_A}"))
    assert member.get("/api/v1/me/").json()["role"] == "member"  # researchers


def test_a_tampered_answer_is_refused_and_recorded(
    api: Callable[..., APIClient], world: World, provider_url: str
) -> None:
    configure(api, provider_url)
    browser = Client(HTTP_HOST=HOST_A)
    back = sign_in(browser, "mallory")
    query = parse_qs(urlsplit(back).query)
    forged = browser.get("/auth/sso/callback/", {"code": query["code"][0] + "x", "state": query["state"][0]})
    assert forged.status_code == 401
    assert "did not verify" in forged.json()["detail"]
    assert browser.get("/api/v1/me/").status_code in (401, 403)
    with schema_context("acme"):
        assert AuditEvent.objects.filter(action="sso.refused").exists()
        assert not User.objects.filter(username="mallory").exists()


def test_a_wrong_issuer_is_refused_when_configured(api: Callable[..., APIClient], provider_url: str) -> None:
    wrong = api("alice").put(
        "/api/v1/sso/",
        {"issuer": provider_url.replace("127.0.0.1", "localhost"), "client_id": "x", "client_secret": "y"},
        format="json",
    )
    assert wrong.status_code == 400
    assert "Wrong issuer" in str(wrong.json())


def test_password_sign_in_is_for_break_glass_admins_only_when_allowed(
    api: Callable[..., APIClient], world: World, provider_url: str
) -> None:
    with schema_context("acme"):
        for name in ("alice", "bob"):
            user = User.objects.get(username=name)
            user.set_password("correct horse")
            user.save()
    configure(api, provider_url, break_glass_passwords=False)
    closed = Client(HTTP_HOST=HOST_A).post("/auth/login/", {"username": "alice", "password": "correct horse"})
    assert closed.status_code == 403
    configure(api, provider_url, break_glass_passwords=True)
    bob = Client(HTTP_HOST=HOST_A).post("/auth/login/", {"username": "bob", "password": "correct horse"})
    assert bob.status_code == 401  # a member is not a break-glass admin
    alice = Client(HTTP_HOST=HOST_A)
    assert alice.post("/auth/login/", {"username": "alice", "password": "correct horse"}).status_code == 200
    assert alice.get("/api/v1/me/").json()["username"] == "alice"


def test_a_sign_in_without_the_username_claim_is_refused_and_recorded(
    api: Callable[..., APIClient], world: World, provider_url: str
) -> None:
    configure(api, provider_url)
    browser = Client(HTTP_HOST=HOST_A)
    refused = browser.get(sign_in(browser, "nameless-one").removeprefix(f"http://{HOST_A}"))
    assert refused.status_code == 401
    assert browser.get("/api/v1/me/").status_code in (401, 403)
    with schema_context("acme"):
        [event] = AuditEvent.objects.filter(action="sso.refused", target="claims of nameless-one")
        assert "'preferred_username' claim" in event.detail["reason"]
        assert not User.objects.filter(email="nameless-one@example.com").exists()


def id_token_from_the_provider(provider_url: str, nonce: str) -> str:
    """A real ID token for the test client, through the provider's own pages and token endpoint."""
    start = f"{provider_url}/auth?" + urlencode(
        {"client_id": CLIENT_ID, "redirect_uri": CALLBACK, "response_type": "code", "scope": "openid",
         "state": "s", "nonce": nonce}
    )  # fmt: skip
    code = parse_qs(urlsplit(through_the_provider(start, "token-holder")).query)["code"][0]
    answer = httpx.post(
        f"{provider_url}/token",
        data={"grant_type": "authorization_code", "code": code, "redirect_uri": CALLBACK},
        auth=(CLIENT_ID, CLIENT_SECRET),
    )
    assert answer.status_code == 200, answer.text
    token: str = answer.json()["id_token"]
    return token


def test_tampered_expired_and_foreign_id_tokens_are_refused(
    api: Callable[..., APIClient], world: World, provider_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    configure(api, provider_url)
    token = id_token_from_the_provider(provider_url, "n-1")
    with schema_context("acme"):
        services.current.set(services.oidc_settings(Provider.objects.get(pk=1), with_secret=True))
        assert TenantOIDCBackend().verify_token(token, nonce="n-1")["sub"] == "token-holder"

        header, payload, signature = token.split(".")
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        forged = (
            base64.urlsafe_b64encode(json.dumps({**claims, "sub": "admin-eve"}).encode()).decode().rstrip("=")
        )
        with pytest.raises(SuspiciousOperation, match="verification failed"):
            TenantOIDCBackend().verify_token(f"{header}.{forged}.{signature}", nonce="n-1")

        later = claims["exp"] + 3600  # the same token, an hour after it expired
        monkeypatch.setattr(jwt.api_jwt, "datetime", _FrozenAt(later))
        with pytest.raises(SuspiciousOperation, match="expired"):
            TenantOIDCBackend().verify_token(token, nonce="n-1")
        monkeypatch.undo()

        services.current.set(
            {
                **services.oidc_settings(Provider.objects.get(pk=1), with_secret=True),
                "OIDC_RP_CLIENT_ID": "other",
            }
        )
        with pytest.raises(SuspiciousOperation, match="not this tenant's client"):
            TenantOIDCBackend().verify_token(token, nonce="n-1")
        services.current.set(None)


class _FrozenAt:
    """Stands in for the datetime module inside PyJWT, whose clock is then `at` (a Unix time)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def now(self, tz: object = None) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.at, tz=datetime.UTC)

    def __getattr__(self, name: str) -> object:
        return getattr(datetime.datetime, name)
