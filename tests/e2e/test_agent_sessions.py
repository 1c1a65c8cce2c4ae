"""An agent session through the whole of Klique: an app whose template asks for a gateway session gets, in
its environment, a key for the tenant's gateway and the gateway's address, from a real bare-metal agent.
The key calls models as its owner, spends its own quota and no more, is metered to its owner under the
session's name, and dies with the session."""

from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.conftest import RackDemo
from tests.e2e.test_apps import TEMPLATE as APP_TEMPLATE
from tests.e2e.test_apps import Route, wait_state
from tests.e2e.test_model_endpoints import client

pytestmark = pytest.mark.e2e

TEMPLATE = {
    **APP_TEMPLATE,  # the small app of the route's tests: its /env says what the session's key is
    "name": "sandbox",
    "title": "Agent sandbox",
    "kind": "agent",
    "gateway_session": {"tokens": 60},
}


def spend_until_refused(session: openai.OpenAI) -> openai.RateLimitError:
    for _ in range(20):
        try:
            session.chat.completions.create(
                model="demo-echo", messages=[{"role": "user", "content": "write the tests"}], max_tokens=8
            )
        except openai.RateLimitError as refused:
            return refused
    raise AssertionError("20 calls and the session's quota never ran out")


def test_an_agent_sessions_key_spends_its_own_quota_and_dies_with_the_session(rack_demo: RackDemo) -> None:
    demo, port = rack_demo.demo, rack_demo.running.port
    demo.call("POST", "/api/v1/catalogue/", json=TEMPLATE)
    app = demo.call("POST", "/api/v1/apps/", json={"entry": "sandbox", "compute_resource": "Research: rack"})
    app = wait_state(demo, app["id"], "ready")
    route = Route(port, app["url"], demo.token)
    key = route.get("/env?name=OPENAI_API_KEY").text
    assert key.startswith("kqs_"), key
    assert route.get("/env?name=OPENAI_BASE_URL").text == f"http://demo.localhost:{port}/v1"

    session = client(port, key)
    assert "demo-echo" in {model.id for model in session.models.list()}
    first = session.chat.completions.create(
        model="demo-echo", messages=[{"role": "user", "content": "plan the change"}], max_tokens=8
    )
    assert first.choices[0].message.content
    # It spends its quota (60 tokens) and is then refused, while its owner's own token still calls.
    refused = spend_until_refused(session)
    assert "session app Agent sandbox's quota" in str(refused), refused
    owner = client(port, demo.token).chat.completions.create(
        model="demo-echo", messages=[{"role": "user", "content": "still here"}], max_tokens=2
    )
    assert owner.choices[0].message.content == "still here"

    # Metered to its owner, under the session's name.
    deadline = time.monotonic() + 30
    while not (rows := demo.call("GET", "/api/v1/gateway/usage/?model=demo-echo")["results"]) or not any(
        row["agent"] == "session app Agent sandbox" for row in rows
    ):
        assert time.monotonic() < deadline, rows
        time.sleep(0.5)
    mine = [row for row in rows if row["agent"] == "session app Agent sandbox"]
    assert {row["username"] for row in mine} == {rows[-1]["username"]}
    assert sum(row["tokens_in"] + row["tokens_out"] for row in mine) <= 60

    # The session ends: its key is dead at once.
    demo.call("POST", f"/api/v1/apps/{app['id']}/stop/")
    wait_state(demo, app["id"], "stopped")
    with pytest.raises(openai.AuthenticationError):
        session.models.list()
