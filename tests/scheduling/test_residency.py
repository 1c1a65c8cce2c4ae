"""Data residency: a project limited to regions never lands outside them. A compute resource given to it
that lists a pool elsewhere is refused when the configuration is validated, and a task of the project
submitted to such a compute resource is refused, each saying which pool and which region."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from tests.scheduling.config import acme_document
from tests.scheduling.test_configuration_api import messages, save_and_validate
from tests.world import World


def regional(*, apollo_on: str = "shared") -> dict[str, Any]:
    """The test configuration with baremetal in eu-west-1 and h100 in us-east-1, and a compute resource
    for project apollo on profile `apollo_on`."""
    document = acme_document()
    document["pools"][0]["region"] = "eu-west-1"
    document["pools"][1]["region"] = "us-east-1"
    document["policies"][0]["compute_resources"] = [
        resource
        for resource in document["policies"][0]["compute_resources"]
        if resource["profile"] != apollo_on
    ] + [{"profile": apollo_on, "name": "Apollo: EU", "projects": ["apollo"]}]
    return document


def limit_apollo(client: APIClient, world: World, regions: list[str]) -> None:
    response = client.patch(f"/api/v1/projects/{world.project_a}/", {"regions": regions}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["regions"] == sorted(regions)


def test_a_compute_resource_given_to_a_project_with_a_pool_elsewhere_is_refused_at_validation(
    api: Callable[..., APIClient], world: World
) -> None:
    limit_apollo(api("carol"), world, ["eu-west-1"])  # carol is apollo's admin
    report = save_and_validate(api("alice"), regional(apollo_on="four-gpu"))  # baremetal (eu) and h100 (us)
    assert report["ok"] is False
    text = messages(report)
    assert "Project apollo keeps its work in eu-west-1" in text
    assert "compute resource Apollo: EU may run it in pool h100 in region us-east-1" in text
    assert "pool baremetal" not in text  # the pool in the region is not named
    report = save_and_validate(api("alice"), regional(apollo_on="shared"))  # baremetal only
    assert report["ok"] is True, messages(report)
    unknown = regional()
    unknown["policies"][0]["compute_resources"][-1]["projects"] = ["zeus"]
    assert "names project zeus, which does not exist" in messages(save_and_validate(api("alice"), unknown))


def test_a_pool_with_no_region_is_outside_every_region(api: Callable[..., APIClient], world: World) -> None:
    limit_apollo(api("carol"), world, ["eu-west-1"])
    document = regional(apollo_on="shared")
    document["pools"][0]["region"] = ""
    assert "pool baremetal in no region" in messages(save_and_validate(api("alice"), document))


def test_a_task_of_a_limited_project_never_lands_outside_its_regions(
    api: Callable[..., APIClient], world: World
) -> None:
    save_and_validate(api("alice"), regional(apollo_on="shared"))
    assert api("alice").post("/api/v1/configuration/draft/provision/").status_code == 200
    limit_apollo(api("carol"), world, ["eu-west-1"])
    bob = api("bob")
    spanning = bob.post(
        "/api/v1/tasks/",
        {"compute_resource": "Research: 4 GPUs", "project": "apollo", "spec": {"command": ["true"]}},
        format="json",
    )
    assert spanning.status_code == 400
    assert "may run it in pool h100 in region us-east-1" in spanning.json()["detail"]
    inside = bob.post(
        "/api/v1/tasks/",
        {
            "compute_resource": "Apollo: EU",
            "project": "apollo",
            "gpus": "0.25",
            "spec": {"command": ["true"]},
        },
        format="json",
    )
    assert inside.status_code == 201, inside.content
    # The project's own compute resource takes its work only.
    for other in ({}, {"project": None}):
        refused = bob.post(
            "/api/v1/tasks/",
            {"compute_resource": "Apollo: EU", "gpus": "0.25", "spec": {"command": ["true"]}, **other},
            format="json",
        )
        assert refused.status_code == 400
        assert "is for the work of project apollo" in refused.json()["detail"]
    # Lifted: anywhere again.
    limit_apollo(api("carol"), world, [])
    anywhere = bob.post(
        "/api/v1/tasks/",
        {"compute_resource": "Research: 4 GPUs", "project": "apollo", "spec": {"command": ["true"]}},
        format="json",
    )
    assert anywhere.status_code == 201, anywhere.content


@pytest.mark.parametrize(
    "regions",
    [
        ["EU-WEST-1"],
        ["eu west"],
        [""],
        ["a" * 51],
        ["eu-west-1;rm"],
        [None],
        [["eu"]],
        ["r"] * 21,
        "eu-west-1",
    ],
)
def test_a_region_that_is_not_a_region_name_is_refused(
    api: Callable[..., APIClient], world: World, regions: Any
) -> None:
    response = api("carol").patch(f"/api/v1/projects/{world.project_a}/", {"regions": regions}, format="json")
    assert response.status_code == 400, response.content
