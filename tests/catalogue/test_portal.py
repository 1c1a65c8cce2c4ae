"""The portal's Apps page: the catalogue with a launch form per entry, the apps a person may see with their
state, GPU time and cost so far, and stop and start for their owner; as the API allows, no more."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.catalogue.models import AppInstance
from apps.scheduling.models import Task, TaskState
from tests.catalogue.conftest import launch
from tests.world import HOST_A, World

pytestmark = pytest.mark.django_db


def signed_in(world: World, persona: str) -> Client:
    client = Client(HTTP_HOST=HOST_A)
    with schema_context(world.tenant_a.schema_name):
        client.force_login(User.objects.get(username=persona))
    return client


def test_a_member_launches_an_entry_with_its_variables_and_sees_it_start(world: World) -> None:
    launch(world, name="warm-up")  # adds the tenant's entry "notebook"
    bob = signed_in(world, "bob")
    page = bob.get("/portal/apps/").content.decode()
    assert 'data-entry="jupyterlab"' in page
    assert 'data-entry="notebook"' in page
    assert 'name="var-NOTEBOOK_DIR" value="/work"' in page
    made = bob.post(
        "/portal/apps/launch/",
        {"entry": "notebook", "name": "mine", "compute_resource": "Research: 4 GPUs", "gpus": "4",
         "var-NOTEBOOK_DIR": "/data", "project": "apollo", "share_with_project": "on"},
    )  # fmt: skip
    assert made.status_code == 200
    assert "mine is starting" in made.content.decode()
    with schema_context(world.tenant_a.schema_name):
        app = AppInstance.objects.get(name="mine")
        project = app.project.name if app.project is not None else None
        assert (app.variables, project, app.shared_with_project) == (
            {"NOTEBOOK_DIR": "/data"},
            "apollo",
            True,
        )
    row = re.search(rf'<tr data-app="{app.pk}" data-state="(\w+)"', made.content.decode())
    assert row is not None
    assert row[1] == "starting"


@pytest.mark.parametrize(
    ("form", "said"),
    [
        ({"entry": "notebook", "var-LD_PRELOAD": "/x.so"}, "not a variable of notebook"),
        ({"entry": "nothing"}, "No catalogue entry nothing"),
        ({"entry": "notebook", "compute_resource": "Dev: 4 GPUs"}, "No compute resource"),
        ({"entry": "notebook", "secrets": "NOPE_TOKEN, "}, "No secret named NOPE_TOKEN"),
    ],
)
def test_a_launch_that_cannot_run_says_why_on_the_page(world: World, form: dict[str, str], said: str) -> None:
    launch(world, name="warm-up")
    answer = signed_in(world, "bob").post("/portal/apps/launch/", form).content.decode()
    assert 'role="alert"' in answer
    assert said in answer


def test_a_viewer_sees_the_catalogue_but_launches_nothing(world: World) -> None:
    dave = signed_in(world, "dave")
    assert "Launch JupyterLab" not in dave.get("/portal/apps/").content.decode()
    refused = dave.post(
        "/portal/apps/launch/", {"entry": "jupyterlab", "compute_resource": "Research: 4 GPUs"}
    )
    assert refused.status_code == 403
    with schema_context(world.tenant_a.schema_name):
        assert not AppInstance.objects.exists()


def test_the_owner_stops_and_starts_an_app_and_others_only_see_it(world: World) -> None:
    app = launch(world, name="shared-one", project="apollo", share_with_project=True)
    with schema_context(world.tenant_a.schema_name):
        Task.objects.filter(pk=str(app.task_id)).update(state=TaskState.RUNNING)
        AppInstance.objects.filter(pk=app.pk).update(tunnel_channel="t")
    carol = signed_in(world, "carol").get("/portal/apps/table/").content.decode()
    assert f'data-app="{app.pk}" data-state="ready"' in carol
    assert f'href="/apps/{app.pk}/"' in carol
    assert "Stop shared-one" not in carol
    assert (
        signed_in(world, "carol").post(f"/portal/apps/{app.pk}/stop/").content.decode().count("Only the app")
        == 1
    )
    bob = signed_in(world, "bob")
    stopped = bob.post(f"/portal/apps/{app.pk}/stop/").content.decode()
    assert "shared-one is stopping" in stopped
    assert f'data-app="{app.pk}" data-state="stopped"' in stopped
    assert "Start shared-one" in stopped
    started = bob.post(f"/portal/apps/{app.pk}/start/").content.decode()
    assert f'data-app="{app.pk}" data-state="starting"' in started
    assert bob.post(f"/portal/apps/{app.pk}/delete/").status_code == 404
    assert signed_in(world, "dave").post(f"/portal/apps/{app.pk}/stop/").status_code == 404
