"""Password sign-in: attempts limited per account and per address with a sentence and an audit row, and
CSRF enforced on /auth/login/ and /auth/logout/ (a form on another site cannot sign a visitor in or out)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django_tenants.utils import schema_context

from apps.accounts.models import SignInFailure, User
from apps.accounts.services import SIGN_IN_PER_ACCOUNT, SIGN_IN_PER_ADDRESS
from apps.audit.models import AuditEvent
from tests.world import HOST_A, HOST_PROVIDER, World

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_password(world: World) -> str:
    with schema_context("acme"):
        alice = User.objects.get(username="alice")
        alice.set_password("correct horse")
        alice.save()
    return "correct horse"


def _post(client: Client, username: str, password: str, address: str = "10.1.1.1") -> int:
    answer = client.post("/auth/login/", {"username": username, "password": password}, REMOTE_ADDR=address)
    return answer.status_code


def test_an_account_waits_after_too_many_wrong_passwords_even_with_the_right_one(alice_password: str) -> None:
    client = Client(HTTP_HOST=HOST_A)
    for _ in range(SIGN_IN_PER_ACCOUNT):
        assert _post(client, "alice", "wrong") == 401
    answer = client.post(
        "/auth/login/", {"username": "alice", "password": alice_password}, REMOTE_ADDR="10.9.9.9"
    )
    assert answer.status_code == 429
    assert answer.json()["detail"].startswith("Too many failed sign-ins for the account alice: wait ")
    with schema_context("acme"):
        assert AuditEvent.objects.filter(action="password.limited", actor="alice").exists()
        SignInFailure.objects.all().delete()  # the window passed
    assert _post(client, "alice", alice_password) == 200


def test_an_address_that_guesses_across_accounts_waits(alice_password: str) -> None:
    client = Client(HTTP_HOST=HOST_A)
    for number in range(SIGN_IN_PER_ADDRESS):
        assert _post(client, f"user{number}", "guess", address="10.2.2.2") == 401
    answer = client.post(
        "/auth/login/", {"username": "alice", "password": alice_password}, REMOTE_ADDR="10.2.2.2"
    )
    assert answer.status_code == 429
    assert "for the address 10.2.2.2" in answer.json()["detail"]
    assert _post(client, "alice", alice_password, address="10.3.3.3") == 200  # another address is not held


def test_a_right_password_clears_the_accounts_count(alice_password: str) -> None:
    client = Client(HTTP_HOST=HOST_A)
    for _ in range(SIGN_IN_PER_ACCOUNT - 1):
        assert _post(client, "alice", "wrong") == 401
    assert _post(client, "alice", alice_password) == 200
    for _ in range(SIGN_IN_PER_ACCOUNT - 1):
        assert _post(client, "alice", "wrong") == 401
    assert _post(client, "alice", alice_password) == 200


def test_the_portal_and_the_management_centre_forms_are_limited_too(
    alice_password: str, world: World
) -> None:
    portal = Client(HTTP_HOST=HOST_A)
    for _ in range(SIGN_IN_PER_ACCOUNT):
        portal.post("/portal/sign-in/", {"username": "alice", "password": "wrong"})
    limited = portal.post("/portal/sign-in/", {"username": "alice", "password": alice_password})
    assert limited.status_code == 429
    assert "Too many failed sign-ins" in limited.content.decode()
    centre = Client(HTTP_HOST=HOST_PROVIDER)
    for _ in range(SIGN_IN_PER_ACCOUNT):
        centre.post("/portal/sign-in/", {"username": "root", "password": "wrong"})
    assert centre.post("/portal/sign-in/", {"username": "root", "password": "x"}).status_code == 429


@pytest.mark.parametrize("path", ["/auth/login/", "/auth/logout/"])
@pytest.mark.parametrize("origin", [None, "https://evil.example", f"http://{HOST_A}"])
def test_a_post_without_the_csrf_token_is_refused(path: str, origin: str | None, alice_password: str) -> None:
    client = Client(HTTP_HOST=HOST_A, enforce_csrf_checks=True)
    extra: dict[str, Any] = {"HTTP_ORIGIN": origin} if origin else {}
    answer = client.post(path, {"username": "alice", "password": alice_password}, **extra)
    assert answer.status_code == 403
    assert "did not come from Klique's own page" in answer.json()["detail"]
    assert "_auth_user_id" not in client.session


def test_a_script_gets_a_token_first_and_signs_in(alice_password: str) -> None:
    client = Client(HTTP_HOST=HOST_A, enforce_csrf_checks=True)
    token = client.get("/auth/login/").json()["csrf_token"]
    forged = client.post(
        "/auth/login/",
        {"username": "alice", "password": alice_password},
        HTTP_X_CSRFTOKEN=token,
        HTTP_ORIGIN="https://evil.example",  # the token alone does not do: the page's origin must be ours
    )
    assert forged.status_code == 403
    signed_in = client.post(
        "/auth/login/",
        {"username": "alice", "password": alice_password},
        HTTP_X_CSRFTOKEN=token,
        HTTP_ORIGIN=f"http://{HOST_A}",
    )
    assert signed_in.status_code == 200, signed_in.content
    assert signed_in.json()["detail"] == "Signed in as alice."
