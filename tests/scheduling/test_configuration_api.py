"""Editing, validating and provisioning the resource configuration."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.resources.models import ComputeResource, Pool
from apps.scheduling.models import Task
from tests.scheduling.config import acme_document
from tests.world import World


def save_and_validate(client: APIClient, document: dict[str, Any]) -> dict[str, Any]:
    saved = client.put("/api/v1/configuration/draft/", {"document": document}, format="json")
    assert saved.status_code == 200, saved.content
    report: dict[str, Any] = client.post("/api/v1/configuration/draft/validate/").json()
    return report


def messages(report: dict[str, Any], kind: str = "errors") -> str:
    return " | ".join(item["message"] for item in report[kind])


def test_the_report_names_every_mistake(api: Callable[..., APIClient], world: World) -> None:
    document = acme_document()
    document["policies"][0]["reservation_gpus"] = "20"  # above its limit of 16, and above what it can reach
    document["profiles"][0]["gpus"] = "16"  # no pool holds 16
    document["profiles"][2]["pools"] = [{"pool": "baremetal"}]  # MIG on a pool without MIG
    document["profiles"][1]["pools"].append({"pool": "nowhere"})
    report = save_and_validate(api("alice"), document)
    assert report["ok"] is False
    text = messages(report)
    assert "reserves 20 GPUs but is limited to 16 GPUs" in text
    assert "asks for 16 GPUs, more than any of its pools holds (the largest has 8 GPUs)" in text
    assert "uses MIG, but these pools do not support it: baremetal" in text
    assert "names unknown pools: nowhere" in text
    assert "Reservations add up to 28 GPUs, above the 16 GPUs of all pools" in text


def test_offline_pools_are_a_warning_not_an_error(api: Callable[..., APIClient], world: World) -> None:
    with schema_context("acme"):
        Pool.objects.update(last_heartbeat_at=None)
    report = save_and_validate(api("alice"), acme_document())
    assert report["ok"] is True
    assert "Every pool of profile four-gpu is offline now" in messages(report, "warnings")


def test_malformed_documents_are_refused_on_save(api: Callable[..., APIClient], world: World) -> None:
    document = acme_document()
    document["profiles"][0]["gpus"] = "0.3.3"
    response = api("alice").put("/api/v1/configuration/draft/", {"document": document}, format="json")
    assert response.status_code == 400
    assert "is not a number of GPUs" in response.json()["detail"]
    assert "gpus" in str(response.json()["errors"]["profiles"])  # the service's InvalidInput keeps the tree
    both = acme_document()
    both["profiles"][0]["min_gpus"] = "1"
    response = api("alice").put("/api/v1/configuration/draft/", {"document": both}, format="json")
    assert "give exactly one size" in response.json()["detail"]


def test_provisioning_refuses_a_draft_with_errors_and_changes_nothing(
    api: Callable[..., APIClient], world: World
) -> None:
    document = acme_document()
    document["policies"][1]["reservation_gpus"] = "32"
    document["pools"].append({"name": "extra", "environment": "slurm", "capacity_gpus": 4})
    save_and_validate(api("alice"), document)
    response = api("alice").post("/api/v1/configuration/draft/provision/")
    assert response.status_code == 400
    assert "Provisioning refused" in response.json()["detail"]
    with schema_context("acme"):
        assert not Pool.objects.filter(name="extra").exists()


def test_provisioning_ends_the_queued_tasks_of_a_removed_compute_resource(
    api: Callable[..., APIClient], world: World
) -> None:
    document = copy.deepcopy(acme_document())
    document["policies"][0]["compute_resources"] = document["policies"][0]["compute_resources"][1:]
    save_and_validate(api("alice"), document)
    with schema_context("acme"):
        pool_ids = dict(Pool.objects.values_list("name", "pk"))
    response = api("alice").post("/api/v1/configuration/draft/provision/")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["ended_tasks"] == 1
    assert body["deleted"]["compute_resources"] == 1
    task = api("bob").get(f"/api/v1/tasks/{world.task_a}/").json()
    assert task["state"] == "aborted"
    assert "Research: 4 GPUs was removed by alice" in task["reason"]
    history = api("bob").get(f"/api/v1/tasks/{world.task_a}/history/").json()
    assert history[-1]["to_state"] == "aborted"
    with schema_context("acme"):
        assert not ComputeResource.objects.filter(name="Research: 4 GPUs").exists()
        # Pools are matched by name, so they keep their identity across provisions.
        assert dict(Pool.objects.values_list("name", "pk")) == pool_ids


def test_a_pool_with_active_tasks_cannot_be_removed(api: Callable[..., APIClient], world: World) -> None:
    with schema_context("acme"):
        Task.objects.filter(pk=world.task_a).update(state="running", pool=Pool.objects.get(name="h100"))
    document = acme_document()
    document["pools"] = document["pools"][:1]
    document["profiles"] = [document["profiles"][0] | {"pools": [{"pool": "baremetal"}]}]
    document["policies"] = [
        policy | {"compute_resources": policy["compute_resources"][:1]} for policy in document["policies"]
    ]
    report = save_and_validate(api("alice"), document)
    assert "Pool h100 has 1 active tasks; drain it before removing it." in messages(report)


def test_the_active_configuration_reads_back_as_the_document(
    api: Callable[..., APIClient], world: World
) -> None:
    active = api("dave").get("/api/v1/configuration/").json()
    assert {pool["name"] for pool in active["pools"]} == {"baremetal", "h100"}
    four = next(profile for profile in active["profiles"] if profile["name"] == "four-gpu")
    assert four["gpus"] == "4"
    multi = next(profile for profile in active["profiles"] if profile["name"] == "multi-node")
    assert (multi["nodes"], multi["gpus_per_node"]) == (2, 4)
    # What reads back provisions again without a change.
    assert save_and_validate(api("alice"), active)["ok"] is True


def test_pools_show_whether_they_are_online_and_what_is_used(
    api: Callable[..., APIClient], world: World
) -> None:
    with schema_context("acme"):
        Task.objects.filter(pk=world.task_a).update(state="running", pool=Pool.objects.get(name="h100"))
    pools = {pool["name"]: pool for pool in api("dave").get("/api/v1/pools/").json()["results"]}
    assert pools["h100"]["online"] is True
    assert pools["h100"]["used_gpus"] == "4"
    assert pools["baremetal"]["used_gpus"] == "0"
