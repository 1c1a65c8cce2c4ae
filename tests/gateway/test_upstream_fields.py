"""Upstream credentials a caller cannot redirect: only OpenAI's fields of each endpoint reach an upstream,
for OpenAI-compatible deployments and LiteLLM's providers alike; where a call goes and which key it
carries come from the configuration alone. A recording server stands where an attacker would point."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest

from gateway.config import Deployment
from gateway.fields import REQUEST_FIELDS, unknown_fields, upstream_payload
from gateway.upstream import _litellm_arguments
from tests.gateway.conftest import echo_document

pytestmark = pytest.mark.django_db

HELLO: list[Any] = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def thief() -> Iterator[tuple[str, list[str]]]:
    """An address a member controls: every request it receives is kept, with its Authorization."""
    received: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(f"{self.path} {self.headers.get('authorization')}")
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"choices": [{"message": {"role": "assistant", "content": "stolen"}}]}')

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", received
    server.shutdown()


@pytest.fixture(scope="module")
def a(gw: Any) -> Iterator[Any]:
    tenant = gw("gwf")
    from gateway import selectors

    echo = str(
        tenant.run(lambda: selectors.settings_get().document["model_list"][0]["litellm_params"]["api_base"])
    )
    document = echo_document(echo)
    adapted = {"model": "together_ai/echo", "api_base": echo, "api_key_secret": "ECHO_KEY"}
    document["model_list"].append({"model_name": "adapted", "litellm_params": adapted})
    tenant.configure(document)
    yield tenant
    tenant.configure(echo_document(echo))


REDIRECTING = [
    "base_url", "api_base", "api_key", "custom_llm_provider", "extra_headers", "headers", "organization",
    "api_version", "litellm_params", "extra_body", "azure_ad_token", "aws_region_name", "vertex_project",
    "model_list", "mock_response", "metadata", "deployment_id", "proxy", "input_cost_per_token",
]  # fmt: skip


@pytest.mark.parametrize("model", ["chat", "adapted"])  # OpenAI-compatible, and through LiteLLM
@pytest.mark.parametrize("field", REDIRECTING)
def test_a_field_that_could_redirect_the_call_is_refused_and_nothing_leaves(
    model: str, field: str, a: Any, thief: tuple[str, list[str]]
) -> None:
    address, received = thief
    value: Any = {"Authorization": "x"} if field in ("extra_headers", "headers") else address
    with pytest.raises(openai.BadRequestError) as refused:
        a.client("ben").chat.completions.create(
            model=model, messages=HELLO, max_tokens=2, extra_body={field: value}
        )
    body: Any = refused.value.body
    assert body["message"].startswith(f"Unrecognized request argument supplied: {field}.")
    assert body["code"] == "unknown_parameter"
    assert received == []


@pytest.mark.parametrize("endpoint", ["completions", "embeddings"])
def test_the_other_endpoints_refuse_them_too(endpoint: str, a: Any, thief: tuple[str, list[str]]) -> None:
    address, received = thief
    client = a.client("ben")
    extra = {"api_base": address}
    if endpoint == "completions":
        with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: api_base"):
            client.completions.create(model="text", prompt="one", max_tokens=1, extra_body=extra)
    else:
        with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: api_base"):
            client.embeddings.create(model="embed", input="one", extra_body=extra)
    assert received == []


def test_openais_own_fields_still_pass(a: Any) -> None:
    reply = a.client("ben").chat.completions.create(
        model="adapted",
        messages=HELLO,
        max_tokens=2,
        temperature=0.1,
        top_p=0.9,
        seed=1,
        user="ben",
        stop=["x"],
    )
    assert reply.choices[0].message.content == "hello there"


def _deployment(provider: str) -> Deployment:
    return Deployment(
        id="d#0", model_name="d", provider=provider, model="m", api_base="http://configured.example/v1",
        api_key_secret="KEY", weight=1.0, timeout=5.0, mode="chat", max_output_tokens=100,
        input_cost_per_million=Decimal(0), output_cost_per_million=Decimal(0),
    )  # fmt: skip


def test_what_litellm_is_given_comes_from_the_list_and_the_configuration_only() -> None:
    """Even a payload that skipped the check gives LiteLLM nothing it would route by."""
    payload = {
        "model": "d",
        "messages": HELLO,
        "max_tokens": 3,
        **dict.fromkeys(REDIRECTING, "http://thief/"),
    }
    arguments = _litellm_arguments(_deployment("together_ai"), "the-key", "chat/completions", payload)
    assert arguments["api_base"] == "http://configured.example/v1"
    assert arguments["api_key"] == "the-key"
    assert arguments["model"] == "together_ai/m"
    assert set(arguments) == {"model", "messages", "max_tokens", "timeout", "api_base", "api_key"}


def test_every_endpoint_has_a_list_without_routing_fields() -> None:
    for endpoint, allowed in REQUEST_FIELDS.items():
        assert not allowed & set(REDIRECTING), endpoint
        body = {"model": "m", "api_base": "x", "temperature": 1}
        assert unknown_fields(endpoint, body) == (
            ["api_base"] if "temperature" in allowed else ["api_base", "temperature"]
        )
        assert "api_base" not in upstream_payload(endpoint, body)


def test_a_member_of_several_projects_names_the_one_that_pays_when_project_budgets_apply(a: Any) -> None:
    """Without the header such a caller's calls used to pass by every project budget."""
    from apps.accounts.models import Role, User
    from apps.accounts.services import project_member_set, project_save
    from gateway import services

    def second_project() -> None:
        from tenants.models import Tenant

        ann, ben = User.objects.get(username="ann"), User.objects.get(username="ben")
        tenant = Tenant.objects.get(schema_name="gwf")
        other = project_save(tenant=tenant, name="second", admin=ann)
        project_member_set(tenant=tenant, project=other, user=ben, role=Role.MEMBER)
        services.budget_create(scope="project", project="lab", unit="tokens", limit=1000, period="month")

    a.run(second_project)
    with pytest.raises(openai.BadRequestError) as refused:
        a.client("ben").chat.completions.create(model="chat", messages=HELLO, max_tokens=2)
    body: Any = refused.value.body
    assert body["code"] == "project_required"
    assert "member of several projects (lab, second)" in body["message"]
    paid = a.client("ben", project="lab").chat.completions.with_raw_response.create(
        model="chat", messages=HELLO, max_tokens=2
    )
    assert a.usage(request_id=paid.headers["x-request-id"])[0].project_name == "lab"
