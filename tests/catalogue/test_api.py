"""The catalogue's API: administrators add entries (every problem listed), people launch apps as tasks of
theirs, see the apps shared with them, and stop and start their own; another tenant sees none of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import Group, User
from apps.catalogue import selectors
from apps.catalogue.models import AppInstance
from apps.scheduling.engine import UNITS_PER_GPU
from apps.scheduling.models import Task
from tests.catalogue.conftest import ENTRY, launch
from tests.world import World

pytestmark = pytest.mark.django_db

Api = Callable[..., APIClient]


def test_an_admin_adds_an_entry_and_every_problem_comes_back_at_once(api: Api) -> None:
    refused = api("alice").post(
        "/api/v1/catalogue/", {"name": "x", "version": "1", "command": [], "port": 1}, format="json"
    )
    assert refused.status_code == 400
    assert refused.json()["errors"]["problems"] == [
        'command: a list of words is required, as ["program", "argument", ...].',
        "port: a port from 1024 to 65535, or null to let the agent pick a free one.",
    ]
    added = api("alice").post("/api/v1/catalogue/", ENTRY, format="json")
    assert added.status_code == 201, added.json()
    assert added.json()["added_by"] == "alice"
    again = api("alice").post("/api/v1/catalogue/", ENTRY, format="json")
    assert again.status_code == 409
    assert "add the template as a new version" in again.json()["detail"]
    shadowing = api("alice").post("/api/v1/catalogue/", {**ENTRY, "name": "jupyterlab"}, format="json")
    assert shadowing.status_code == 409
    assert api("bob").post("/api/v1/catalogue/", {**ENTRY, "version": "2"}, format="json").status_code == 403
    listed = api("dave").get("/api/v1/catalogue/").json()["results"]
    assert {(entry["name"], entry["shipped"]) for entry in listed} >= {
        ("jupyterlab", True),
        ("notebook", False),
    }


def test_a_member_launches_an_app_that_is_a_task_of_theirs(api: Api, world: World) -> None:
    api("alice").post("/api/v1/catalogue/", ENTRY, format="json")
    made = api("bob").post(
        "/api/v1/apps/", {"entry": "notebook", "variables": {"NOTEBOOK_DIR": "/data"}}, format="json"
    )
    assert made.status_code == 201, made.json()
    app = made.json()
    assert (app["state"], app["owner"], app["compute_resource"]) == ("starting", "bob", "Research: 4 GPUs")
    assert app["address"] == f"http://acme.klique.test/apps/{app['id']}/"
    assert app["url"].startswith("http://app-")
    assert app["url"].endswith(".acme.klique.test/")
    with schema_context(world.tenant_a.schema_name):
        task = Task.objects.get(pk=app["task_id"])
        assert (task.submitter.username, task.max_attempts, task.size_units) == ("bob", 1, 4 * UNITS_PER_GPU)
        assert task.spec["app"]["instance"] == app["id"]
        assert task.spec["environment"] == {"NOTEBOOK_DIR": "/data"}
        assert task.spec["command"] == ENTRY["command"]


@pytest.mark.parametrize(
    ("body", "status", "said"),
    [
        ({"entry": "nothing"}, 404, "the catalogue has agent-sandbox, code-server, jupyterlab"),
        ({"entry": "notebook", "variables": {"LD_PRELOAD": "/x.so"}}, 400, "not a variable of notebook"),
        ({"entry": "notebook", "variables": {"NOTEBOOK_DIR": ["a"]}}, 400, "variables.NOTEBOOK_DIR: text"),
        ({"entry": "notebook", "compute_resource": "Dev: 4 GPUs"}, 400, "No compute resource 'Dev: 4 GPUs'"),
        ({"entry": "jupyterlab"}, 400, "names no compute resource of its own"),
        ({"entry": "notebook", "groups": ["dev"]}, 403, "only with groups you are in"),
        ({"entry": "notebook", "groups": ["nobody"]}, 400, "No group nobody"),
        ({"entry": "notebook", "share_with_project": True}, 400, "needs a project"),
    ],
)
def test_a_launch_that_cannot_run_says_why(api: Api, body: dict[str, Any], status: int, said: str) -> None:
    api("alice").post("/api/v1/catalogue/", ENTRY, format="json")
    refused = api("bob").post("/api/v1/apps/", body, format="json")
    assert refused.status_code == status, refused.json()
    assert said in refused.json()["detail"]


def test_a_viewer_cannot_launch(api: Api) -> None:
    api("alice").post("/api/v1/catalogue/", ENTRY, format="json")
    assert api("dave").post("/api/v1/apps/", {"entry": "notebook"}, format="json").status_code == 403


def test_apps_are_seen_and_reached_by_those_they_are_shared_with(api: Api, world: World) -> None:
    private = launch(world, name="private")
    with_project = launch(world, name="apollo's", project="apollo", share_with_project=True)
    with_group = launch(world, name="club's", groups=["reading-club"])
    with schema_context(world.tenant_a.schema_name):
        people = {name: User.objects.get(username=name) for name in ("alice", "bob", "carol", "dave")}
        Group.objects.get(name="reading-club").members.add(people["dave"])
        reach = {
            (app.name, person): selectors.can_reach(people[person], AppInstance.objects.get(pk=app.pk))
            for app in (private, with_project, with_group)
            for person in people
        }
    assert {key for key, allowed in reach.items() if allowed} == {
        (private.name, "bob"), (with_project.name, "bob"), (with_group.name, "bob"),
        (with_project.name, "carol"), (with_project.name, "alice"), (with_group.name, "dave"),
    }  # fmt: skip  # (alice is in apollo; as tenant admin she sees every app, and reaches only those)
    seen = {row["id"] for row in api("carol").get("/api/v1/apps/").json()["results"]}
    assert seen == {str(with_project.pk)}
    assert api("carol").get(f"/api/v1/apps/{private.pk}/").status_code == 404
    assert len(api("alice").get("/api/v1/apps/").json()["results"]) == 3
    assert api("charlie").get(f"/api/v1/apps/{private.pk}/").status_code == 404
    assert api("charlie").get("/api/v1/apps/").json()["results"] == []


def test_the_owner_stops_and_starts_an_app_again(api: Api, world: World) -> None:
    app = launch(world, project="apollo", share_with_project=True)
    assert api("carol").post(f"/api/v1/apps/{app.pk}/stop/").status_code == 403
    stopped = api("bob").post(f"/api/v1/apps/{app.pk}/stop/")
    assert stopped.status_code == 200, stopped.json()
    assert (stopped.json()["state"], stopped.json()["detail"]) == ("stopped", "Stopped by bob.")
    with schema_context(world.tenant_a.schema_name):
        assert Task.objects.get(pk=str(app.task_id)).state == "aborted"
    again = api("bob").post(f"/api/v1/apps/{app.pk}/stop/")
    assert again.status_code == 400
    assert "stopped already" in again.json()["detail"]
    started = api("bob").post(f"/api/v1/apps/{app.pk}/start/")
    assert started.status_code == 200
    assert started.json()["state"] == "starting"
    assert started.json()["task_id"] != str(app.task_id)
    assert api("bob").post(f"/api/v1/apps/{app.pk}/start/").status_code == 409


def test_an_app_is_given_the_vault_secrets_its_entry_and_its_user_name(api: Api, world: World) -> None:
    api("alice").post("/api/v1/catalogue/", {**ENTRY, "secrets": ["WANDB_API_KEY"]}, format="json")
    for name in ("WANDB_API_KEY", "HF_TOKEN"):
        kept = api("bob").post(
            "/api/v1/secrets/", {"scope": "user", "name": name, "value": "s3cr3t"}, format="json"
        )
        assert kept.status_code == 201, kept.json()
    made = api("bob").post("/api/v1/apps/", {"entry": "notebook", "secrets": ["HF_TOKEN"]}, format="json")
    assert made.status_code == 201, made.json()
    assert made.json()["secrets"] == ["HF_TOKEN"]
    with schema_context(world.tenant_a.schema_name):
        task = Task.objects.get(pk=made.json()["task_id"])
        assert task.spec["secrets"] == ["WANDB_API_KEY", "HF_TOKEN"]
        assert "s3cr3t" not in str(task.spec)  # names only: the vault resolves them at dispatch


@pytest.mark.parametrize(
    ("names", "said"),
    [
        (["NOPE_TOKEN"], "No secret named NOPE_TOKEN"),
        (["LD_PRELOAD"], "secrets[0]:"),
        (["PORT"], "PORT is the agent's"),
    ],
)
def test_a_secret_an_app_cannot_be_given_is_refused(api: Api, names: list[str], said: str) -> None:
    api("alice").post("/api/v1/catalogue/", ENTRY, format="json")
    refused = api("bob").post("/api/v1/apps/", {"entry": "notebook", "secrets": names}, format="json")
    assert refused.status_code == 400, refused.json()
    assert said in refused.json()["detail"]
