"""Bad input gets a 400 with a sentence, never a 500, and nothing stored can make a later path fail: NULs
refused at the edge, every number bounded, output names checked, store failures said in words."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.metering.models import LedgerEvent, Rejection
from apps.resources.models import Pool
from apps.scheduling.models import Task, TaskRun, TaskState
from tests.world import World

pytestmark = pytest.mark.django_db

NUL_QUERIES = [
    "/api/v1/audit/?action=%00", "/api/v1/audit/?actor=a%00b", "/api/v1/tasks/?state=%00",
    "/api/v1/tasks/?id_prefix=x%00", "/api/v1/usage/?user=%00", "/api/v1/gateway/usage/?model=%00",
    "/api/v1/usage/summary/?by=%00", "/api/v1/queue-wait/?by=%00", "/api/v1/tasks/?%00=1",
]  # fmt: skip


@pytest.mark.parametrize("path", NUL_QUERIES)
def test_a_nul_in_a_query_is_refused_at_the_edge(
    path: str, api: Callable[..., APIClient], world: World
) -> None:
    answer = api("alice").get(path)
    assert answer.status_code == 400, answer.content
    assert "NUL characters" in answer.json()["detail"]


NUL_BODIES = [
    ("post", "/api/v1/groups/", {"name": "a\u0000b"}),
    ("post", "/api/v1/projects/", {"name": "p", "description": "x\u0000"}),
    ("post", "/api/v1/users/", {"username": "u\u0000", "email": "a@b.c", "role": "member"}),
    ("post", "/api/v1/tokens/", {"name": "t\u0000"}),
    ("post", "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "spec": {"command": ["a\u0000"]}}),
    ("post", "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "spec": {"k\u0000": 1}}),
    ("put", "/api/v1/price-book/", {"gpu_hour": {"H\u0000": "1"}, "tokens_million": {}, "gb_month": "0"}),
    ("post", "/api/v1/secrets/", {"name": "A", "value": "x", "scope": "project", "project": "\u0000"}),
    ("post", "/api/v1/usage/events/", {"events": [{"event_id": "n\u0000", "kind": "tokens"}]}),
    ("put", "/api/v1/configuration/draft/", {"document": {"k": {"": {"\u00e2\u0019\u0000": 1}}}}),
]


@pytest.mark.parametrize(("method", "path", "body"), NUL_BODIES)
def test_a_nul_anywhere_in_a_json_body_is_refused(
    method: str, path: str, body: dict[str, Any], api: Callable[..., APIClient], world: World
) -> None:
    answer = getattr(api("alice"), method)(path, body, format="json")
    assert answer.status_code == 400, answer.content
    assert "NUL characters" in answer.json()["detail"]


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/api/v1/configuration/draft/", rb'{"document": {"k\ud800": {"": 1}}}'),
        ("/api/v1/configuration/draft/", rb'{"document": {"pools": [{"name": "lone \udfff"}]}}'),
        ("/api/v1/gateway/", rb'{"document": {"model_list": [], "x": "\ud83d"}}'),
    ],
)
def test_an_unpaired_surrogate_in_json_is_refused(
    path: str, raw: bytes, api: Callable[..., APIClient], world: World
) -> None:
    """JSON's \\ud800 escapes decode to code points no database text can hold."""
    answer = api("alice").generic("PUT", path, raw.decode(), content_type="application/json")
    assert answer.status_code == 400, answer.content
    assert "unpaired surrogates" in answer.json()["detail"]


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_nul_in_a_put_form_is_refused(
    content_type: str, api: Callable[..., APIClient], world: World
) -> None:
    """A PUT form is parsed by the API, not by Django's request.POST: it is checked there."""
    from django.test.client import BOUNDARY, encode_multipart

    fields = {"document": '{"pools": [], "k\\u0000": 1}'}
    if content_type.startswith("multipart"):
        body, content_type = (
            encode_multipart(BOUNDARY, fields).decode(),
            f"multipart/form-data; boundary={BOUNDARY}",
        )
    else:
        body = "document=%7B%22k%00%22%3A1%7D"
    answer = api("alice").generic("PUT", "/api/v1/configuration/draft/", body, content_type=content_type)
    assert answer.status_code == 400, answer.content
    assert "NUL characters" in answer.json()["detail"]


def test_a_nul_in_a_sign_in_form_is_refused(world: World) -> None:
    from django.test import Client

    from tests.world import HOST_A

    answer = Client(HTTP_HOST=HOST_A).post("/auth/login/", {"username": "al\x00ice", "password": "x"})
    assert answer.status_code == 400
    assert "NUL characters" in answer.json()["detail"]


BUDGET = {"scope": "tenant"}
UNBOUNDED = [
    ("post", "/api/v1/tokens/", {"name": "t", "agent": "bot", "scope": "submit", "gpu_quota": "1e30"}),
    ("post", "/api/v1/tokens/", {"name": "t", "agent": "bot", "scope": "submit", "gpu_quota": "1E+400"}),
    ("post", "/api/v1/tokens/", {"name": "t", "agent": "bot", "scope": "submit", "gpu_quota": "-3"}),
    ("post", "/api/v1/tokens/", {"name": "t", "expires_in_days": 10**12}),
    ("post", "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "gpus": "1E+400"}),
    ("post", "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "priority": 10**30}),
    ("post", "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "max_attempts": 10**30}),
    ("post", "/api/v1/gateway/budgets/", {**BUDGET, "unit": "usd", "limit": "1E+400", "period": "none"}),
    ("post", "/api/v1/gateway/budgets/", {**BUDGET, "unit": "tokens", "limit": 10**30, "period": "month"}),
    ("put", "/api/v1/price-book/", {"gpu_hour": {"H100": "1E+400"}, "tokens_million": {}, "gb_month": "0"}),
    ("put", "/api/v1/price-book/", {"gpu_hour": {}, "tokens_million": {"m": {"in": "1e9"}}, "gb_month": "0"}),
    ("post", "/api/v1/configuration/draft/simulate/", {"days": 10**30}),
    ("post", "/api/v1/configuration/draft/simulate/", {"interval_seconds": 1e308}),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body"), UNBOUNDED)
def test_an_unbounded_number_is_refused_with_its_bounds(
    method: str, path: str, body: dict[str, Any], api: Callable[..., APIClient], world: World
) -> None:
    answer = getattr(api("alice"), method)(path, body, format="json")
    assert answer.status_code == 400, answer.content
    assert answer.json()["detail"], answer.content


def test_a_top_up_is_bounded(api: Callable[..., APIClient], world: World) -> None:
    for amount in ("1E+400", "-5", "1e30", "NaN"):
        answer = api("alice").post(
            f"/api/v1/gateway/budgets/{world.wallet_a}/top-up/", {"amount": amount}, format="json"
        )
        assert answer.status_code == 400, (amount, answer.content)


@pytest.mark.parametrize(
    "event",
    [
        {"tokens_in": 10**30, "tokens_out": 1},
        {"tokens_in": 1, "tokens_out": 2**63},
        {"tokens_in": -1, "tokens_out": 1},
        {"tokens_in": 1.5, "tokens_out": 1},
        {"tokens_in": 1, "tokens_out": 1, "model": "m" * 500},
        {"tokens_in": 1, "tokens_out": 1, "cost_nano_usd": 10**30},
    ],
)
def test_usage_events_beyond_what_a_row_holds_are_refused_and_kept_as_rejections(
    event: dict[str, Any], api: Callable[..., APIClient], world: World
) -> None:
    sent = {"event_id": "huge-1", "kind": "tokens", "started_at": "2026-11-05T09:00:00+00:00", "user": "bob"}
    sent.setdefault("model", "chat")
    answer = api("alice").post("/api/v1/usage/events/", {"events": [{**sent, **event}]}, format="json")
    assert answer.status_code in (200, 400), answer.content
    with schema_context("acme"):
        assert not LedgerEvent.objects.filter(event_id="huge-1").exists()
        if answer.status_code == 200:
            assert Rejection.objects.filter(event_id="huge-1").exists()


def test_a_huge_price_kept_before_the_bounds_cannot_break_a_runs_end(world: World) -> None:
    """The metering of a run at its end (the agent's result) must not fail on a stored price."""
    from apps.metering.ledger import Event, ingest
    from apps.metering.models import PriceBook

    with schema_context("acme"):
        PriceBook.objects.update_or_create(pk=1, defaults={"gpu_hour": {"*": "1E+400"}})
        result = ingest(
            [
                Event(
                    event_id="run-end-1", kind="gpu", started_at=_ago(2), ended_at=_ago(1),
                    user="bob", pool="h100", gpus="4", source="scheduler",
                )
            ]
        )  # fmt: skip
        assert not LedgerEvent.objects.filter(event_id="run-end-1").exists()
        assert result is not None


def _ago(hours: int) -> Any:
    from datetime import timedelta

    from django.utils import timezone

    return timezone.now() - timedelta(hours=hours)


@pytest.mark.parametrize(
    ("name", "status"),
    [(".", 400), ("./", 400), ("a//b", 201), ("a/./b", 201), ("a/b/c", 201), ("x/" * 20 + "y", 400)],
)
def test_output_names_are_plain_relative_paths(name: str, status: int, world: World) -> None:
    agent = _running_on_h100(world)
    # The store keeps its files across tests: each case that stores one does so in a folder of its own.
    where = f"{uuid.uuid4().hex}/" if status == 201 else ""
    answer = agent.put(f"/agents/v1/tasks/{world.task_a}/outputs/{where}{name}", b"data", content_type="a/b")
    assert answer.status_code == status, answer.content
    if status == 400:
        assert "cannot name an output" in answer.json()["detail"]


def test_an_output_in_the_way_of_another_is_said_in_words(world: World) -> None:
    agent = _running_on_h100(world)
    base = f"/agents/v1/tasks/{world.task_a}/outputs/{uuid.uuid4().hex}"
    assert agent.put(f"{base}/a", b"file", content_type="a/b").status_code == 201
    under = agent.put(f"{base}/a/b", b"x", content_type="a/b")
    assert under.status_code == 409  # not retried: the name clashes with what the run stored
    assert "could not be stored: a part of its path is an output file already" in under.json()["detail"]
    assert agent.put(f"{base}/c/d", b"x", content_type="a/b").status_code == 201
    over = agent.put(f"{base}/c", b"x", content_type="a/b")
    assert over.status_code == 409
    assert "could not be stored: a folder of that name holds other outputs" in over.json()["detail"]


def _running_on_h100(world: World) -> APIClient:
    """The agent of h100, uploading for bob's task as if it ran there under a lease."""
    lease = uuid.uuid4()
    with schema_context("acme"):
        h100 = Pool.objects.get(name="h100")
        Task.objects.filter(pk=world.task_a).update(state=TaskState.RUNNING, pool=h100, lease_id=lease)
        TaskRun.objects.create(
            lease_id=lease, task_id=world.task_a, attempt=1, pool=h100, dispatched_at=timezone.now()
        )
    return APIClient(
        HTTP_HOST="acme.klique.test",
        HTTP_AUTHORIZATION=f"Bearer {world.agent_secret_a}",
        HTTP_X_KLIQUE_LEASE=str(lease),
    )
