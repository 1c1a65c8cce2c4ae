"""Requests for tenants go through one guarded client: loopback, link-local, private and the plane's own
addresses are refused after DNS resolution and on every redirect, in every spelling of an address, and
errors never echo what such an address answered. The suite's settings allow loopback (its model servers
and identity provider listen there); these tests take that away."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from apps.core import outbound
from gateway.config import Deployment
from gateway.upstream import UpstreamError, _error_message, _litellm_call, call
from tests.world import World

INTERNAL_BODY = b"REDIS-INTERNAL-ANSWER-7f3a"

REFUSED = [
    "http://127.0.0.1:6379/", "http://localhost:5432/", "http://127.1/", "http://0.0.0.0/",
    "http://2130706433/", "http://0x7f000001/", "http://0x7f.1/", "http://017700000001/",
    "http://[::1]/", "http://[::ffff:127.0.0.1]/", "http://[::ffff:7f00:1]/", "http://[2002:7f00:1::]/",
    "http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/", "http://10.0.0.1/",
    "http://172.16.0.1/", "http://192.168.1.1/", "http://100.64.0.1/", "http://[fc00::1]/",
    "http://224.0.0.1/", "http://[::]/",
]  # fmt: skip


@pytest.fixture
def nothing_private() -> Iterator[None]:
    with override_settings(KLIQUE_OUTBOUND_ALLOW=[]):
        outbound._own_addresses.cache_clear()
        yield
    outbound._own_addresses.cache_clear()


@pytest.fixture
def internal() -> Iterator[tuple[str, list[str]]]:
    """A service on loopback, as PostgreSQL, Redis or the plane's own API would be: what it was asked."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(INTERNAL_BODY)

        do_POST = do_GET  # noqa: N815 -- the name http.server looks for

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()


@pytest.mark.usefixtures("nothing_private")
@pytest.mark.parametrize("url", REFUSED)
def test_every_spelling_of_an_internal_address_is_refused(url: str) -> None:
    with pytest.raises(outbound.OutboundRefused, match="cannot be reached from Klique") as refused:
        outbound.check_url(url)
    assert "KLIQUE_OUTBOUND_ALLOW" in str(refused.value)


@pytest.mark.usefixtures("nothing_private")
@pytest.mark.parametrize(
    "url", ["ftp://example.com/", "file:///etc/passwd", "gopher://127.0.0.1/", "http:///x"]
)
def test_only_http_addresses_are_called(url: str) -> None:
    with pytest.raises(outbound.OutboundRefused, match="not an http"):
        outbound.check_url(url)


@pytest.mark.usefixtures("nothing_private")
def test_a_public_address_passes_and_the_connection_goes_where_it_was_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = socket.getaddrinfo

    def resolving(host: str, *args: Any, **kwargs: Any) -> Any:
        table = {"public.example": ["93.184.216.34"], "mixed.example": ["93.184.216.34", "127.0.0.1"]}
        if host in table:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 80)) for address in table[host]]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolving)
    assert outbound.check_url("https://public.example/v1") == "93.184.216.34"
    with pytest.raises(outbound.OutboundRefused, match=r"127\.0\.0\.1 is loopback"):
        outbound.check_url("https://mixed.example/v1")  # the system could pick either: refused


def test_the_planes_own_address_is_refused_though_public(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo

    def resolving(host: str, *args: Any, **kwargs: Any) -> Any:
        if host in ("plane.example", "alias.example"):
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", 443))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolving)
    with override_settings(KLIQUE_OUTBOUND_ALLOW=[], ALLOWED_HOSTS=["plane.example", ".plane.example"]):
        outbound._own_addresses.cache_clear()
        with pytest.raises(outbound.OutboundRefused, match="control plane's own address"):
            outbound.check_url("https://alias.example/")
    outbound._own_addresses.cache_clear()


def test_an_allowed_range_is_reached_and_a_redirect_out_of_it_is_refused(
    internal: tuple[str, list[str]],
) -> None:
    """A server on 127.0.0.2 (allowed) redirects to 127.0.0.1 (not): each hop's connection is checked."""
    address, asked = internal

    class Redirect(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", f"{address}/secret")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.2", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with override_settings(KLIQUE_OUTBOUND_ALLOW=["127.0.0.2/32"]):
            with outbound.client(follow_redirects=False) as http:
                assert http.get(f"http://127.0.0.2:{server.server_address[1]}/").status_code == 302
            with (
                outbound.client(follow_redirects=True) as http,
                pytest.raises(outbound.OutboundRefused, match=r"127\.0\.0\.1 is loopback"),
            ):
                http.get(f"http://127.0.0.2:{server.server_address[1]}/")
    finally:
        server.shutdown()
    assert asked == []


@pytest.mark.django_db
@pytest.mark.usefixtures("nothing_private")
@pytest.mark.parametrize("where", ["", "/.well-known", "/redis"])
def test_an_sso_issuer_on_an_internal_address_is_refused_without_its_answer(
    where: str, api: Callable[..., APIClient], world: World, internal: tuple[str, list[str]]
) -> None:
    address, asked = internal
    body = {"issuer": f"{address}{where}", "client_id": "x", "client_secret": "y"}
    answer = api("alice").put("/api/v1/sso/", body, format="json")
    assert answer.status_code == 400
    assert "is loopback" in answer.json()["detail"]
    assert INTERNAL_BODY.decode() not in answer.content.decode()
    assert asked == []


def _deployment(provider: str, api_base: str) -> Deployment:
    return Deployment(
        id="chat#0", model_name="chat", provider=provider, model="m", api_base=api_base, api_key_secret="",
        weight=1.0, timeout=5.0, mode="chat", max_output_tokens=10,
        input_cost_per_million=Decimal(0), output_cost_per_million=Decimal(0),
    )  # fmt: skip


@pytest.mark.usefixtures("nothing_private")
@pytest.mark.parametrize("provider", ["openai", "together_ai"])  # straight over HTTP, and through LiteLLM
def test_a_gateway_call_to_an_internal_address_is_refused_at_call_time(
    provider: str, internal: tuple[str, list[str]]
) -> None:
    address, asked = internal
    deployment = _deployment(provider, f"{address}/v1")
    payload = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def scenario() -> None:
        async with outbound.async_client() as http:
            if provider == "openai":
                await call(http, deployment, "key", "chat/completions", payload)
            else:
                await _litellm_call(deployment, "key", "chat/completions", payload)

    with pytest.raises(UpstreamError, match="is loopback") as refused:
        asyncio.run(scenario())
    assert INTERNAL_BODY.decode() not in str(refused.value)
    assert asked == []


@pytest.mark.django_db
@pytest.mark.usefixtures("nothing_private")
def test_a_gateway_deployment_on_an_internal_address_is_refused_when_saved(world: World) -> None:
    from django_tenants.utils import schema_context

    from apps.accounts.models import User
    from apps.core.errors import InvalidInput
    from gateway.services import settings_save

    litellm_params = {"model": "openai/m", "api_base": "http://169.254.169.254/v1"}
    document = {"model_list": [{"model_name": "chat", "litellm_params": litellm_params}]}
    with schema_context("acme"), pytest.raises(InvalidInput, match="link-local"):
        settings_save(user=User.objects.get(username="alice"), document=document)


def test_upstream_errors_never_echo_a_body() -> None:
    page = httpx.Response(500, text=f"<html>{INTERNAL_BODY.decode()}</html>")
    assert _error_message(page) == "Internal Server Error"
    odd = httpx.Response(400, json={"detail": INTERNAL_BODY.decode()})
    assert INTERNAL_BODY.decode() not in _error_message(odd)
    openai_style = httpx.Response(400, json={"error": {"message": "max_tokens is too large"}})
    assert _error_message(openai_style) == "max_tokens is too large"
