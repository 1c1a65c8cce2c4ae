"""`klique simulate`: the draft against the provisioned configuration, on history or a trace."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.resources.models import Pool
from apps.scheduling.models import Task
from klique.cli import parse_args
from klique.commands import run
from klique.sdk import Client
from tests.django_transport import DjangoTransport
from tests.scheduling.config import acme_document
from tests.scheduling.endpoints import TRACE
from tests.world import World


def make_history(world: World) -> None:
    """Ten 4-GPU tasks of Research that ran for two hours each over the last day."""
    with schema_context("acme"):
        first = Task.objects.get(pk=world.task_a)
        start = timezone.now() - timedelta(days=1)
        for index in range(10):
            submitted = start + timedelta(minutes=10 * index)
            Task.objects.create(
                compute_resource=first.compute_resource,
                compute_resource_name=first.compute_resource_name,
                submitter=first.submitter,
                size_units=first.size_units,
                state="completed",
                submitted_at=submitted,
                queued_at=submitted,
                started_at=submitted,
                ended_at=submitted + timedelta(hours=2),
                pool=Pool.objects.first(),
            )


def test_a_smaller_draft_shows_longer_waits_on_the_tenant_s_own_history(
    api: Callable[..., APIClient], world: World
) -> None:
    make_history(world)
    smaller = acme_document()
    smaller["pools"][1]["capacity_gpus"] = 4  # h100 halves
    assert (
        api("alice").put("/api/v1/configuration/draft/", {"document": smaller}, format="json").status_code
        == 200
    )
    response = api("alice").post("/api/v1/configuration/draft/simulate/", {"days": 2}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["jobs"] == 10
    current, proposed = body["current"], body["proposed"]
    assert current["finished"] == proposed["finished"] == 10
    assert proposed["wait_p95_seconds"] > current["wait_p95_seconds"]
    assert proposed["mean_completion_seconds"] > current["mean_completion_seconds"]


def test_a_draft_that_drops_a_compute_resource_refuses_its_jobs(
    api: Callable[..., APIClient], world: World
) -> None:
    document = acme_document()
    document["policies"][0]["compute_resources"] = document["policies"][0]["compute_resources"][1:]
    api("alice").put("/api/v1/configuration/draft/", {"document": document}, format="json")
    body = api("alice").post("/api/v1/configuration/draft/simulate/", {"trace": TRACE}, format="json").json()
    assert (body["current"]["refused"], body["proposed"]["refused"]) == (0, 2)


def test_nothing_to_replay_is_explained(api: Callable[..., APIClient], world: World) -> None:
    response = api("alice").post("/api/v1/configuration/draft/simulate/", {"days": 1}, format="json")
    assert response.status_code == 400
    assert "nothing to replay" in response.json()["detail"]
    bad = api("alice").post(
        "/api/v1/configuration/draft/simulate/",
        {"trace": "timestamp,duration,num_gpus,compute_resource\nyesterday,1,1,x\n"},
        format="json",
    )
    assert "Trace line 2" in bad.json()["detail"]


def test_the_cli_prints_both_columns(
    world: World, db: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    client = Client("http://acme.klique.test", world.tokens["alice"], transport=DjangoTransport())
    assert run(parse_args(["simulate", "--trace", str(trace)]), client) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["CURRENT", "PROPOSED", "(DRAFT)"]
    assert "jobs replayed" in out
    assert "queue wait p95" in out
    assert run(parse_args(["simulate", "--trace", str(tmp_path / "missing.csv")]), client) == 1
    assert "Cannot read the trace" in capsys.readouterr().out


def test_each_team_is_shown_before_and_after_with_what_got_worse(
    api: Callable[..., APIClient], world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_history(world)
    smaller = acme_document()
    smaller["pools"][1]["capacity_gpus"] = 4  # h100 halves: Research's waits grow
    api("alice").put("/api/v1/configuration/draft/", {"document": smaller}, format="json")
    body = api("alice").post("/api/v1/configuration/draft/simulate/", {"days": 2}, format="json").json()
    teams = {team["policy"]: team for team in body["proposed"]["teams"]}
    research = teams["research"]
    assert research["jobs_started"] == 10
    assert (
        research["wait_p95_seconds"]
        > {t["policy"]: t for t in body["current"]["teams"]}["research"]["wait_p95_seconds"]
    )
    assert research["gpu_hours"] == pytest.approx(10 * 4 * 2, rel=0.02)  # ten 4-GPU tasks of two hours
    assert research["preemptions_suffered"] == 0
    assert research["reservation_gpus"] > 0

    client = Client("http://acme.klique.test", world.tokens["alice"], transport=DjangoTransport())
    assert run(parse_args(["simulate", "--days", "2"]), client) == 0
    out = capsys.readouterr().out
    assert "Per team (policy), current -> proposed" in out
    research_line = next(line for line in out.splitlines() if line.startswith("research"))
    assert "WORSE" in research_line
    assert run(parse_args(["simulate", "--days", "2", "--json"]), client) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {team["policy"] for team in printed["current"]["teams"]} >= {"research"}
