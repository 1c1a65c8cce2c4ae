"""Where a tenant has single sign-on, /mcp names its identity provider as the authorization server
(RFC 9728) and takes the access tokens that provider issues for it: a JWT for exactly this resource
(RFC 8707), signed by the provider's keys, naming a person of the tenant. Tokens come from a real
OpenID Connect provider (tests/oidc/provider.mjs) through its own login pages, as an MCP client gets
them; tokens for another resource, tampered, forged with a shared secret, without the person's name, or
for someone Klique does not know are refused, each saying why."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx
import jwt
import pytest
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import ApiToken, Role, User
from apps.mcp.identity import Identity, NotServed, identity_for
from apps.mcp.metadata import protected_resource
from tests.sso.test_sso import (
    CALLBACK,
    CLIENT_ID,
    CLIENT_SECRET,
    configure,
    provider_url,
    through_the_provider,
)
from tests.world import HOST_A, HOST_B, World

__all__ = ["provider_url"]  # the identity provider, started once for the session (tests/sso)

pytestmark = pytest.mark.django_db

ORIGIN = f"http://{HOST_A}"
RESOURCE = f"{ORIGIN}/mcp"


def access_token(issuer: str, login: str, *, scope: str = "openid submit", resource: str = RESOURCE) -> str:
    """An access token for `resource`, got as an MCP client gets one: the authorization code flow with a
    resource indicator, through the provider's own login page, then the code exchanged at its token
    endpoint."""
    metadata = httpx.get(f"{issuer}/.well-known/openid-configuration", timeout=10).json()
    asked = {"client_id": CLIENT_ID, "response_type": "code", "redirect_uri": CALLBACK, "scope": scope,
             "resource": resource, "state": "s", "nonce": "n"}  # fmt: skip
    back = through_the_provider(f"{metadata['authorization_endpoint']}?{urlencode(asked)}", login)
    code = parse_qs(urlsplit(back).query)["code"][0]
    answer = httpx.post(
        metadata["token_endpoint"],
        data={
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": CALLBACK,
            "resource": resource,
        },
        auth=(CLIENT_ID, CLIENT_SECRET),
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    token: str = answer.json()["access_token"]
    assert token.count(".") == 2, token  # a JWT, as the provider issues for a resource
    return token


def person(username: str, role: str = Role.MEMBER) -> None:
    with schema_context("acme"):
        User.objects.get_or_create(username=username, defaults={"role": role})


def refused(presented: str, host: str = HOST_A, origin: str = ORIGIN) -> str:
    with pytest.raises(NotServed) as caught:
        identity_for(host=host, presented=presented, origin=origin)
    assert caught.value.status == 401
    assert caught.value.invalid_token
    return str(caught.value)


def test_the_metadata_names_the_provider_and_its_tokens_act_as_the_person(
    api: Callable[..., APIClient], world: World, provider_url: str
) -> None:
    status, before = protected_resource(host=HOST_A, origin=ORIGIN)
    assert status == 200
    assert "authorization_servers" not in before  # no single sign-on yet: only Klique tokens
    configure(api, provider_url)
    status, document = protected_resource(host=HOST_A, origin=ORIGIN)
    assert (document["resource"], document["authorization_servers"]) == (RESOURCE, [provider_url])
    assert document["scopes_supported"] == ["read", "submit"]
    assert "authorization_servers" not in protected_resource(host=HOST_B, origin=f"http://{HOST_B}")[1]

    person("rita")
    submitting = identity_for(host=HOST_A, presented=access_token(provider_url, "rita"), origin=ORIGIN)
    assert isinstance(submitting, Identity)
    assert (submitting.user.username, submitting.token.scope, submitting.token.agent) == (
        "rita",
        "submit",
        "",
    )
    assert submitting.token.acting == "rita"
    with schema_context("acme"):
        assert not ApiToken.objects.filter(user__username="rita").exists()  # nothing stored for it
    reading = identity_for(
        host=HOST_A, presented=access_token(provider_url, "rita", scope="openid read"), origin=ORIGIN
    )
    assert reading.token.scope == "read"  # the scope the provider granted, never more


def test_tokens_for_another_resource_or_person_tampered_or_forged_are_refused(
    api: Callable[..., APIClient], world: World, provider_url: str
) -> None:
    configure(api, provider_url)
    person("otto")
    elsewhere = access_token(provider_url, "otto", resource="https://other.example/mcp")
    assert "is not for http://acme.klique.test/mcp" in refused(elsewhere)

    good = access_token(provider_url, "otto")
    assert "is not for" in refused(good, origin="http://evil.example")  # the same token, another address
    head, body, signature = good.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["preferred_username"] = "alice"  # an admin
    swapped = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    assert "refused" in refused(f"{head}.{swapped}.{signature}")
    forged = jwt.encode({**claims, "exp": int(time.time()) + 60}, CLIENT_SECRET, algorithm="HS256")
    assert "HS256" in refused(forged)  # a shared secret never signs for a person here
    unsigned = jwt.encode({**claims}, "", algorithm="none")
    assert "'none'" in refused(unsigned)
    assert "neither a Klique token nor a JWT" in refused("not-a-token-at-all")

    assert "carries no 'preferred_username' claim" in refused(access_token(provider_url, "nameless-nell"))
    assert "No active person 'ghost'" in refused(access_token(provider_url, "ghost"))
    with schema_context("acme"):
        User.objects.filter(username="otto").update(is_active=False)
    assert "No active person 'otto'" in refused(good)
    # A tenant without single sign-on takes Klique tokens only.
    assert "Malformed token" in refused(good, host=HOST_B, origin=f"http://{HOST_B}")
