"""The catalogue's endpoints, declared for the battery (tests/battery.py). The app a path names is made
when the path is asked for, inside the test's own transaction: bob's, on tenant A."""

from __future__ import annotations

from typing import Any

from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.catalogue import services
from apps.catalogue.models import CatalogueEntry
from tests.battery import Endpoint, fixed
from tests.catalogue.conftest import ENTRY
from tests.world import World


def _entry(world: World) -> None:
    with schema_context(world.tenant_a.schema_name):
        if not CatalogueEntry.objects.filter(name=ENTRY["name"]).exists():
            services.entry_add(user=User.objects.get(username="alice"), document=ENTRY)


def bobs_app(world: World, *, stopped: bool = False) -> str:
    _entry(world)
    with schema_context(world.tenant_a.schema_name):
        bob = User.objects.get(username="bob")
        app = services.app_launch(tenant=world.tenant_a, user=bob, entry=ENTRY["name"])
        if stopped:
            services.app_stop(tenant=world.tenant_a, user=bob, app=app)
        return str(app.pk)


def launch_body(world: World) -> dict[str, Any]:
    """A shipped entry, which every tenant's catalogue has."""
    return {"entry": "jupyterlab", "compute_resource": "Research: 4 GPUs", "gpus": "4"}


ENDPOINTS = [
    Endpoint("GET", "api/v1/catalogue/", "viewer", fixed("/api/v1/catalogue/")),
    Endpoint(
        "POST",
        "api/v1/catalogue/",
        "admin",
        fixed("/api/v1/catalogue/"),
        body=lambda w: {**ENTRY, "name": "battery-app"},
        bad_body={"name": "Bad Name", "command": []},
        expect=201,
    ),
    Endpoint("GET", "api/v1/apps/", "viewer", fixed("/api/v1/apps/"), a_ids=lambda w: [bobs_app(w)]),
    Endpoint(
        "POST",
        "api/v1/apps/",
        "member",
        fixed("/api/v1/apps/"),
        body=launch_body,
        bad_body={"entry": "jupyterlab", "variables": {"LD_PRELOAD": "/x.so"}},
        expect=201,
    ),
    Endpoint(
        "GET",
        "api/v1/apps/<uuid:app_id>/",
        "viewer",
        lambda w: f"/api/v1/apps/{bobs_app(w)}/",
        names_object=True,
        owner="bob",  # not shared: another person (not an admin) does not find it
    ),
    Endpoint(
        "POST",
        "api/v1/apps/<uuid:app_id>/stop/",
        "member",
        lambda w: f"/api/v1/apps/{bobs_app(w)}/stop/",
        names_object=True,
        owner="bob",
        others=403,  # a viewer is refused for the role before anything is looked up
    ),
    Endpoint(
        "POST",
        "api/v1/apps/<uuid:app_id>/start/",
        "member",
        lambda w: f"/api/v1/apps/{bobs_app(w, stopped=True)}/start/",
        names_object=True,
        owner="bob",
        others=403,
    ),
]
