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


def test_each_compute_resource_and_objective_is_judged_on_waits_known_in_advance() -> None:
    """Two pools. Four 8-GPU jobs of an hour arrive together on `big` (a pool of 8 GPUs): they run one
    after another, so they wait 0, 1, 2 and 3 hours. Two 1-GPU jobs of an hour arrive together on
    `small` (a pool of 1 GPU): they wait 0 and 1 hour. The figures are read off those waits."""
    from apps.configuration.simulation import Objective, objective_dict, resources_list
    from apps.scheduling.engine import Policy, Profile, Queue, units
    from apps.scheduling.engine import Pool as EnginePool
    from apps.scheduling.engine.simulate import Job, Setup, replay

    hour = 3600.0
    setup = Setup(
        "two pools",
        (EnginePool("p", units(8)), EnginePool("s", units(1))),
        (Profile("whole", ("p",)), Profile("tiny", ("s",))),
        (Policy("team", units(9), units(9)),),
        (Queue("big", "team", "whole"), Queue("small", "team", "tiny")),
    )
    jobs = tuple(
        [Job(f"big-{i}", "big", 0.0, hour, units(8), "team") for i in range(4)]
        + [Job(f"small-{i}", "small", 0.0, hour, units(1), "team") for i in range(2)]
    )
    outcome = replay(setup, jobs, interval=60.0)
    assert sorted(round(wait / hour) for wait in outcome.job_waits.values()) == [0, 0, 1, 1, 2, 3]
    rows = {row["compute_resource"]: row for row in resources_list(outcome, jobs)}
    assert (rows["big"]["jobs"], rows["big"]["jobs_started"]) == (4, 4)
    assert rows["big"]["wait_p50_seconds"] == pytest.approx(2 * hour, abs=60)  # the rank at or above half
    assert rows["big"]["wait_p99_seconds"] == pytest.approx(3 * hour, abs=60)
    assert rows["small"]["wait_p95_seconds"] == pytest.approx(hour, abs=60)

    p75 = objective_dict(outcome, Objective("big-p75", None, "big", 75, 1.5 * hour), jobs)
    assert (p75["jobs_started"], p75["attainment"], p75["met"]) == (4, 0.5, False)
    assert p75["value_seconds"] == pytest.approx(3 * hour, abs=60)
    team = objective_dict(outcome, Objective("team-p60", "team", None, 60, 1.5 * hour), jobs)
    assert (team["jobs_started"], team["attainment"], team["met"]) == (6, 0.6667, True)  # 4 of 6
    sized = objective_dict(
        outcome, Objective("small-ones", "team", None, 90, 1.5 * hour, None, units(2)), jobs
    )
    assert (sized["jobs_started"], sized["attainment"], sized["met"]) == (2, 1.0, True)
    nobody = objective_dict(outcome, Objective("none", "other", None, 90, hour), jobs)
    assert (nobody["jobs_started"], nobody["attainment"], nobody["met"]) == (0, None, None)


def test_the_replay_reports_each_compute_resource_and_the_tenant_s_objectives(
    api: Callable[..., APIClient], world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_history(world)
    smaller = acme_document()
    smaller["pools"][1]["capacity_gpus"] = 4
    api("alice").put("/api/v1/configuration/draft/", {"document": smaller}, format="json")
    body = api("alice").post("/api/v1/configuration/draft/simulate/", {"days": 2}, format="json").json()
    for side in ("current", "proposed"):
        resources = {row["compute_resource"]: row for row in body[side]["resources"]}
        assert resources["Research: 4 GPUs"]["jobs"] == 10
        (objective,) = body[side]["objectives"]  # research-p95 of tests/world.py
        assert (objective["objective"], objective["policy"], objective["jobs_started"]) == (
            "research-p95", "research", 10,
        )  # fmt: skip
        team = next(team for team in body[side]["teams"] if team["policy"] == "research")
        assert objective["value_seconds"] == team["wait_p95_seconds"]
    assert body["proposed"]["objectives"][0]["attainment"] <= body["current"]["objectives"][0]["attainment"]

    client = Client("http://acme.klique.test", world.tokens["alice"], transport=DjangoTransport())
    assert run(parse_args(["simulate", "--days", "2"]), client) == 0
    out = capsys.readouterr().out
    assert "Per compute resource, current -> proposed" in out
    assert "Queue-wait objectives, current -> proposed" in out
    assert next(line for line in out.splitlines() if line.startswith("research-p95"))
