"""The gateway through the official `openai` client: each endpoint, streaming, errors in OpenAI's format,
fallbacks, budgets that run out mid-stream, guardrails, delegated tokens and tenant isolation."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.gateway.conftest import ECHO_KEY, echo_document

pytestmark = pytest.mark.django_db

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def said(error: openai.APIStatusError) -> str:
    """The sentence of an OpenAI-style error, without the client's 'Error code: ...' in front."""
    body: Any = error.body
    return str(body["message"])


@pytest.fixture
def a(gw: Any) -> Any:
    tenant = gw("gwa")
    yield tenant
    tenant.clear_budgets()


def test_chat_completion_is_answered_and_metered_once(a: Any) -> None:
    raw = a.client("ben").chat.completions.with_raw_response.create(
        model="chat", messages=HELLO, max_tokens=5
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == "hello there hello there hello"
    assert reply.model == "chat"  # the group's name, whichever deployment answered
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (2, 5)
    request_id = raw.headers["x-request-id"]
    (row,) = a.usage(request_id=request_id)
    assert (row.username, row.project_name, row.model, row.endpoint) == (
        "ben",
        "lab",
        "chat",
        "chat.completions",
    )
    assert row.deployment in {"chat#0", "chat#1"}
    assert (row.tokens_in, row.tokens_out, row.status) == (2, 5, "ok")
    assert row.cost_nano_usd == 2 * 1_000 + 5 * 2_000  # 1 and 2 USD per million tokens


def test_streaming_relays_every_chunk_and_the_usage_asked_for(a: Any) -> None:
    stream = a.client("ben").chat.completions.create(
        model="chat", messages=HELLO, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == "hello there hello there hello there"
    assert chunks[-1].usage.completion_tokens == 6
    assert {chunk.model for chunk in chunks} == {"chat"}
    (row,) = a.usage(request_id=stream.response.headers["x-request-id"])
    assert (row.tokens_out, row.status) == (6, "ok")


def test_a_stream_without_include_usage_gets_no_usage_chunk(a: Any) -> None:
    chunks = list(
        a.client("ben").chat.completions.create(model="chat", messages=HELLO, max_tokens=2, stream=True)
    )
    assert all(chunk.usage is None for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello there"


def test_completions_embeddings_and_models(a: Any) -> None:
    client = a.client("ben")
    text = client.completions.create(model="text", prompt="one two", max_tokens=3)
    assert text.choices[0].text == "one two one"
    vectors = client.embeddings.create(model="embed", input=["a b", "c"])
    assert [len(item.embedding) for item in vectors.data] == [8, 8]
    assert {model.id for model in client.models.list()} == {
        "chat",
        "chat-backup",
        "broken",
        "slow",
        "text",
        "embed",
    }
    assert client.models.retrieve("chat").id == "chat"
    rows = a.usage(username="ben", endpoint="embeddings")
    assert rows[-1].tokens_in == 3


def test_errors_come_in_openais_format_with_a_sentence(a: Any, gw: Any) -> None:
    with pytest.raises(openai.AuthenticationError) as bad:
        a.client("ben", api_key="klq_aaaaaaaa_" + "x" * 32).chat.completions.create(
            model="chat", messages=HELLO
        )
    assert "no such token" in bad.value.message
    assert bad.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as unknown:
        a.client("ben").chat.completions.create(model="gpt-9", messages=HELLO)
    assert "This tenant's models: broken, chat" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as wrong_endpoint:
        a.client("ben").embeddings.create(model="chat", input="x")
    assert "does not serve /v1/embeddings" in wrong_endpoint.value.message
    with pytest.raises(openai.BadRequestError) as bad_tokens:
        a.client("ben").chat.completions.create(model="chat", messages=HELLO, max_tokens=0)
    assert "max_tokens must be a whole number" in bad_tokens.value.message
    response = httpx.post(
        f"http://127.0.0.1:{a.ports[0]}/v1/chat/completions",
        content=b"{not json",
        headers={"Host": a.host, "Authorization": f"Bearer {a.tokens['ben']}"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("The request body is not JSON")
    assert response.headers["x-request-id"].startswith("kqr-")
    nowhere = httpx.get(f"http://127.0.0.1:{a.ports[0]}/v1/models", headers={"Host": "nobody.klique.test"})
    assert nowhere.status_code == 404
    assert "No tenant is served at 'nobody.klique.test'" in nowhere.json()["error"]["message"]


def test_scopes_and_roles_decide_who_calls(a: Any) -> None:
    reader = a.client("ben-read")
    assert reader.models.list().data == []  # a read token calls nothing, so it lists nothing to call
    with pytest.raises(openai.PermissionDeniedError) as refused:
        reader.chat.completions.create(model="chat", messages=HELLO)
    assert "a read-scope token may only list models" in refused.value.message
    with pytest.raises(openai.PermissionDeniedError):
        a.client("vic").chat.completions.create(model="chat", messages=HELLO)
    agent = a.client("ben-agent").with_raw_response.chat.completions.create(
        model="chat", messages=HELLO, max_tokens=1
    )
    (row,) = a.usage(request_id=agent.headers["x-request-id"])
    assert (row.username, row.agent) == ("ben", "claude")


def test_a_project_is_chosen_with_openais_project_header(a: Any) -> None:
    raw = a.client("ann", project="lab").chat.completions.with_raw_response.create(
        model="chat", messages=HELLO
    )
    assert a.usage(request_id=raw.headers["x-request-id"])[0].project_name == "lab"
    with pytest.raises(openai.PermissionDeniedError) as refused:
        a.client("ben", project="elsewhere").chat.completions.create(model="chat", messages=HELLO)
    assert "ben is not a member of project 'elsewhere'" in refused.value.message


def test_a_failing_deployment_falls_back_to_the_next_group(a: Any) -> None:
    raw = a.client("ben").chat.completions.with_raw_response.create(
        model="broken", messages=HELLO, max_tokens=2
    )
    assert raw.parse().choices[0].message.content == "hello there"
    assert raw.parse().model == "broken"
    (row,) = a.usage(request_id=raw.headers["x-request-id"])
    assert (row.deployment, row.status) == ("chat-backup#2", "ok")
    streamed = list(
        a.client("ben").chat.completions.create(model="broken", messages=HELLO, max_tokens=2, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "hello there"


def test_when_every_deployment_fails_the_call_fails_and_costs_nothing(a: Any) -> None:
    document = echo_document(_echo(a))
    document["router_settings"] = {"num_retries": 0}  # no fallback for "broken"
    a.configure(document)
    try:
        with pytest.raises(openai.InternalServerError) as failed:
            a.client("ben").chat.completions.create(model="broken", messages=HELLO)
        assert "No deployment of 'broken' answered" in failed.value.message
        assert "broken#3 answered 500: echo-fail is down" in failed.value.message
        row = a.usage(model="broken", status="failed")[-1]
        assert (row.tokens_in, row.tokens_out, row.cost_nano_usd) == (0, 0, 0)
    finally:
        a.configure(echo_document(_echo(a)))


def _echo(a: Any) -> str:
    from gateway import selectors

    return str(
        a.run(lambda: selectors.settings_get().document["model_list"][0]["litellm_params"]["api_base"])
    )


def new_project(a: Any, name: str, *members: str) -> None:
    from apps.accounts.models import User
    from apps.accounts.services import project_member_set, project_save
    from tenants.models import Tenant

    def make() -> None:
        tenant = Tenant.objects.get(slug=a.slug)
        project = project_save(tenant=tenant, name=name, admin=User.objects.get(username="ann"))
        for member in members:
            project_member_set(
                tenant=tenant, project=project, user=User.objects.get(username=member), role="member"
            )

    a.run(make)


def test_a_budget_that_runs_out_mid_stream_cuts_the_stream_and_then_refuses(a: Any) -> None:
    new_project(a, "frugal", "ben")
    # ben's prompt is estimated at 3 + 4 + 5 = 12 tokens; 30 tokens leave room for 18 of a 50-token reply.
    a.budget(scope="project", project="frugal", unit="tokens", limit=30, period="day")
    frugal = a.client("ben", project="frugal")
    stream = frugal.chat.completions.create(model="chat", messages=HELLO, max_tokens=50, stream=True)
    assert stream.response.headers["x-klique-budget-limited"] == "18"
    words: list[str] = []
    with pytest.raises(openai.APIError) as cut:
        words.extend(chunk.choices[0].delta.content or "" for chunk in stream)
    assert "A budget ran out: the reply was cut after 18 tokens" in cut.value.message
    assert len("".join(words).split()) == 18
    (row,) = a.usage(request_id=stream.response.headers["x-request-id"])
    assert (row.tokens_in, row.tokens_out, row.status) == (2, 18, "cut")
    with pytest.raises(openai.RateLimitError) as refused:
        frugal.chat.completions.create(model="chat", messages=HELLO)
    assert refused.value.code == "insufficient_quota"
    assert said(refused.value) == (
        "No room left in project frugal's daily budget this day: 20 tokens of 30 tokens spent. "
        "Ask a tenant admin to raise it or top it up, or wait for the next day."
    )
    # Outside the project, ben's calls are not the project's to pay for.
    assert (
        a.client("ben", project="lab")
        .chat.completions.create(model="chat", messages=HELLO, max_tokens=1)
        .choices
    )


def test_an_upstream_that_ignores_max_tokens_is_cut_at_the_budget(a: Any, gw: Any) -> None:
    document = echo_document(_echo(a))
    document["model_list"][0]["litellm_params"]["model"] = "openai/echo-deaf"
    document["model_list"].pop(1)
    a.configure(document)
    try:
        stream = a.client("ben").chat.completions.create(
            model="chat", messages=HELLO, max_tokens=4, stream=True
        )
        with pytest.raises(openai.APIError, match="cut after 4 tokens"):
            list(stream)
    finally:
        a.configure(echo_document(_echo(a)))


def test_a_wallet_is_topped_up(a: Any) -> None:
    from gateway import services
    from gateway.models import Budget

    wallet = a.budget(scope="user", user="ben", unit="usd", limit="0.00003", period="none")
    # A call holds its prompt's estimate (12 tokens at 1 USD/M) and a token of reply (2 USD/M): 14 µUSD;
    # it costs 2 tokens in and 1 out: 4 µUSD. Five fit before the hold would overdraw the wallet.
    for _ in range(5):
        a.client("ben").chat.completions.create(model="chat", messages=HELLO, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as refused:
        a.client("ben").chat.completions.create(model="chat", messages=HELLO, max_tokens=1)
    assert said(refused.value) == (
        "No room left in ben's wallet: 0.00002 USD of 0.00003 USD spent. "
        "Ask a tenant admin to raise it or top it up."
    )
    a.run(lambda: services.budget_top_up(budget=Budget.objects.get(pk=wallet), amount=1))
    assert a.client("ben").chat.completions.create(model="chat", messages=HELLO, max_tokens=1).choices


def test_guardrails_refuse_and_redact_with_a_reason(a: Any) -> None:
    guardrails = {
        "blocked_terms": ["project x"],
        "pii": {"action": "redact", "kinds": ["email", "credit_card"]},
        "max_tokens_cap": 8,
        "models_by_role": {"member": ["chat"]},
    }
    a.configure(echo_document(_echo(a), guardrails=guardrails))
    try:
        client = a.client("ben")
        with pytest.raises(openai.BadRequestError) as blocked:
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "about Project X"}]
            )
        assert blocked.value.code == "blocked_term"
        assert "blocked term 'Project X'" in blocked.value.message
        redacted = client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "mail bob@example.com card 4111 1111 1111 1111"}],
            max_tokens=4,
        )
        assert redacted.choices[0].message.content == "mail [REDACTED:EMAIL] card [REDACTED:CREDIT_CARD]"
        with pytest.raises(openai.BadRequestError, match="above this tenant's cap of 8"):
            client.chat.completions.create(model="chat", messages=HELLO, max_tokens=9)
        with pytest.raises(openai.PermissionDeniedError, match="may not call 'text'"):
            client.completions.create(model="text", prompt="hi")
        assert [model.id for model in client.models.list()] == ["chat"]
    finally:
        a.configure(echo_document(_echo(a)))


def test_guardrails_check_the_reply_whole_and_streamed(a: Any) -> None:
    document = echo_document(_echo(a), guardrails={"pii": {"action": "refuse", "kinds": ["email"]}})
    document["model_list"] = [
        {**entry, "litellm_params": {**entry["litellm_params"], "model": "openai/echo-leak"}}
        if entry["model_name"] == "chat"
        else entry
        for entry in document["model_list"]
    ]
    a.configure(document)
    try:
        client = a.client("ben")
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="chat", messages=HELLO, max_tokens=5)
        assert refused.value.code == "pii_refused"
        assert "The reply contains personal data (email)" in refused.value.message
        row = a.usage(username="ben", status="refused")[-1]
        assert row.tokens_out == 5  # made, so paid for, but withheld
        text: list[str] = []
        stream = client.chat.completions.create(model="chat", messages=HELLO, max_tokens=5, stream=True)
        with pytest.raises(openai.APIError, match="The reply contains personal data"):
            text.extend(chunk.choices[0].delta.content or "" for chunk in stream)
        assert "admin@example.com" not in "".join(text)
    finally:
        a.configure(echo_document(_echo(a)))


def test_another_tenants_token_models_and_budgets_stay_theirs(a: Any, gw: Any) -> None:
    b = gw("gwb")
    b.configure({"model_list": [echo_document(_echo(a))["model_list"][0] | {"model_name": "b-chat"}]})
    with pytest.raises(openai.AuthenticationError) as foreign:
        a.client("ben", api_key=b.tokens["ben"]).chat.completions.create(model="chat", messages=HELLO)
    assert "This token belongs to another tenant" in foreign.value.message
    with pytest.raises(openai.NotFoundError):  # B's token at B's address: A's models are not there
        b.client("ben").chat.completions.create(model="chat", messages=HELLO)
    assert [model.id for model in b.client("ben").models.list()] == ["b-chat"]
    b.budget(scope="tenant", unit="tokens", limit=0, period="month")
    with pytest.raises(openai.RateLimitError, match="No room left in the tenant's monthly budget"):
        b.client("ben").chat.completions.create(model="b-chat", messages=HELLO)
    assert a.client("ben").chat.completions.create(model="chat", messages=HELLO, max_tokens=1).choices
    assert b.usage(model="chat") == []
    b.clear_budgets()


def test_a_revoked_token_stops_at_once_in_every_process(a: Any) -> None:
    from apps.accounts.models import ApiToken, User
    from apps.accounts.services import token_create, token_revoke
    from tenants.models import Tenant

    issued = a.run(
        lambda: token_create(
            tenant=Tenant.objects.get(slug=a.slug), user=User.objects.get(username="ben"), name="short"
        )
    )
    for index in (0, 1):
        assert a.client("ben", port_index=index, api_key=issued.secret).models.list().data
    a.run(lambda: token_revoke(token=ApiToken.objects.get(pk=issued.token.pk)))
    for index in (0, 1):
        with pytest.raises(openai.AuthenticationError, match="was revoked"):
            a.client("ben", port_index=index, api_key=issued.secret).chat.completions.create(
                model="chat", messages=HELLO
            )


def test_the_upstream_key_comes_from_the_vault_and_a_wrong_one_is_named(a: Any) -> None:
    """The upstream checks its key (ECHO_API_KEY): every call above carried it from the vault."""
    from apps.accounts.models import User
    from apps.vault.services import secret_set

    ann = lambda: User.objects.get(username="ann")  # noqa: E731
    a.run(lambda: secret_set(user=ann(), scope="tenant", name="WRONG_KEY", value="sk-wrong"))
    document = echo_document(_echo(a))
    document["model_list"][0]["litellm_params"]["api_key_secret"] = "WRONG_KEY"
    document["model_list"].pop(1)
    a.configure(document)
    try:
        with pytest.raises(openai.InternalServerError) as refused:
            a.client("ben").chat.completions.create(model="chat", messages=HELLO)
        assert "chat#0 answered 401" in refused.value.message
        assert "refused the key in vault secret WRONG_KEY" in refused.value.message
        assert ECHO_KEY not in str(
            a.run(lambda: __import__("gateway.services").selectors.settings_get().document)
        )
    finally:
        a.configure(echo_document(_echo(a)))


def test_providers_that_are_not_openai_compatible_go_through_litellm(a: Any) -> None:
    """together_ai is one of LiteLLM's providers (its adapter posts OpenAI's format to api_base): the
    gateway hands the call to LiteLLM and relays its answer, streamed or not, in OpenAI's format."""
    document = echo_document(_echo(a))
    document["model_list"].append(
        {
            "model_name": "adapted",
            "litellm_params": {
                "model": "together_ai/echo",
                "api_base": _echo(a),
                "api_key_secret": "ECHO_KEY",
            },
        }
    )
    a.configure(document)
    try:
        client = a.client("ben")
        raw = client.chat.completions.with_raw_response.create(model="adapted", messages=HELLO, max_tokens=3)
        assert raw.parse().choices[0].message.content == "hello there hello"
        (row,) = a.usage(request_id=raw.headers["x-request-id"])
        assert (row.deployment, row.tokens_in, row.tokens_out) == ("adapted#7", 2, 3)
        stream = client.chat.completions.create(model="adapted", messages=HELLO, max_tokens=3, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "hello there hello"
        (row,) = a.usage(request_id=stream.response.headers["x-request-id"])
        assert (row.tokens_out, row.status) == (3, "ok")
    finally:
        a.configure(echo_document(_echo(a)))


def test_a_provider_litellm_does_not_know_is_refused_when_saved(a: Any) -> None:
    from apps.core.errors import InvalidInput

    document = echo_document(_echo(a))
    document["model_list"][0]["litellm_params"]["model"] = "skynet/echo"
    with pytest.raises(InvalidInput, match="LiteLLM knows no provider 'skynet'"):
        a.configure(document)


def test_a_rejected_token_is_in_the_audit_log_by_its_prefix(a: Any) -> None:
    from apps.audit.models import AuditEvent

    with pytest.raises(openai.AuthenticationError):
        a.client("ben", api_key="klq_zzzzzzzz_" + "y" * 32).models.list()
    event = a.run(lambda: AuditEvent.objects.filter(action="token.rejected").order_by("-at").first())
    assert (event.actor, event.target) == ("klq_zzzzzzzz", "GET /v1/models")
    assert "no such token" in event.detail["reason"]
    assert "y" * 32 not in str(event.detail)


def test_a_delegated_tokens_refused_call_is_audited(a: Any) -> None:
    from apps.audit.models import AuditEvent

    document = echo_document(_echo(a), guardrails={"models_by_role": {"member": ["chat"]}})
    a.configure(document)
    try:
        with pytest.raises(openai.PermissionDeniedError):
            a.client("ben-agent").completions.create(model="text", prompt="hi")
    finally:
        a.configure(echo_document(_echo(a)))
    event = a.run(lambda: AuditEvent.objects.filter(action="token.refused").order_by("-at").first())
    assert (event.actor, event.on_behalf_of, event.target) == (
        "agent claude for ben",
        "ben",
        "POST /v1/completions",
    )
    assert "may not call 'text'" in event.detail["reason"]


def test_n_is_checked(a: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="n must be a whole number from 1 to 16"):
        a.client("ben").chat.completions.create(model="chat", messages=HELLO, n=17)


def test_a_suspended_tenant_stops_at_its_next_call(a: Any) -> None:
    from apps.provider.services import tenant_resume, tenant_suspend
    from tenants.models import Tenant

    assert a.client("ben").models.list().data
    a.run(lambda: tenant_suspend(tenant=Tenant.objects.get(slug=a.slug), reason="invoice overdue"))
    try:
        with pytest.raises(openai.PermissionDeniedError, match="suspended: invoice overdue"):
            a.client("ben").chat.completions.create(model="chat", messages=HELLO)
    finally:
        a.run(lambda: tenant_resume(tenant=Tenant.objects.get(slug=a.slug)))
    assert a.client("ben").chat.completions.create(model="chat", messages=HELLO, max_tokens=1).choices


def test_a_service_account_calls_with_its_own_token(a: Any) -> None:
    raw = a.client("bot").chat.completions.with_raw_response.create(
        model="chat", messages=HELLO, max_tokens=2
    )
    (row,) = a.usage(request_id=raw.headers["x-request-id"])
    assert (row.username, row.project_name, row.tokens_out) == ("nightly-eval", "", 2)


def test_serving_the_gateway_does_not_import_litellm() -> None:
    """Importing LiteLLM takes seconds: the web process must start without it."""
    probe = "import config.asgi, sys; print('litellm' in sys.modules)"
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    printed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=environment
    ).stdout
    assert printed.strip().splitlines()[-1] == "False"


def test_a_changed_configuration_applies_to_the_next_call_in_every_process(a: Any) -> None:
    for index in (0, 1):  # both processes have the configuration cached
        a.client("ben", port_index=index).chat.completions.create(model="chat", messages=HELLO, max_tokens=1)
    document = echo_document(_echo(a), guardrails={"blocked_terms": ["hello"]})
    document["model_list"].append({**document["model_list"][0], "model_name": "fresh"})
    a.configure(document)
    try:
        for index in (0, 1):
            client = a.client("ben", port_index=index)
            fresh = client.chat.completions.create(
                model="fresh", messages=[{"role": "user", "content": "hi"}]
            )
            assert fresh.choices[0].message.content.startswith("hi hi")
            with pytest.raises(openai.BadRequestError, match="blocked term 'hello'"):
                client.chat.completions.create(model="chat", messages=HELLO)
    finally:
        a.configure(echo_document(_echo(a)))
    with pytest.raises(openai.NotFoundError):
        a.client("ben", port_index=1).chat.completions.create(model="fresh", messages=HELLO)


def test_one_wallet_pays_for_gpu_time_and_gateway_calls(a: Any) -> None:
    """GPU runs of a project are charged to the same live counter its gateway calls draw from."""
    from django.utils import timezone

    from apps.accounts.models import Project
    from gateway.wallets import charge

    new_project(a, "shared-wallet", "ben")
    a.budget(scope="project", project="shared-wallet", unit="usd", limit="0.001", period="none")
    client = a.client("ben", project="shared-wallet")
    assert client.chat.completions.create(model="chat", messages=HELLO, max_tokens=1).choices  # a call
    project_id = a.run(lambda: str(Project.objects.get(name="shared-wallet").pk))
    a.run(
        lambda: charge(
            user_id=a.user_ids["ben"], project_id=project_id, cost_nano_usd=10**9, at=timezone.now()
        )
    )
    with pytest.raises(openai.RateLimitError) as refused:  # 1 USD of GPU time spent the wallet
        client.chat.completions.create(model="chat", messages=HELLO, max_tokens=1)
    assert said(refused.value).startswith(
        "No room left in project shared-wallet's wallet: 1.000004 USD of 0.001 USD"
    )


def test_calls_tokens_and_latency_are_in_the_metrics(a: Any) -> None:
    a.client("ben").chat.completions.create(model="chat", messages=HELLO, max_tokens=3)
    text = httpx.get(f"http://127.0.0.1:{a.ports[0]}/metrics").text
    ok = [
        line
        for line in text.splitlines()
        if line.startswith("klique_gateway_calls_total{") and 'tenant="gwa"' in line
    ]
    assert any(
        'model="chat"' in line and 'status="ok"' in line and float(line.split()[-1]) >= 1 for line in ok
    )
    assert 'klique_gateway_tokens_total{direction="out",model="chat",tenant="gwa"}' in text
    assert 'klique_gateway_call_duration_seconds_count{model="chat"}' in text
