"""Submitting, listing, cancelling tasks; why they wait; their history; and what submit refuses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import User
from apps.resources.models import ResourcePolicy
from apps.scheduling import services
from apps.scheduling.cycle import run_cycle
from apps.scheduling.models import Task
from tenants.models import Tenant
from tests.world import World


def submit(client: APIClient, body: object) -> Any:
    return client.post("/api/v1/tasks/", body, format="json")


def test_submit_one_and_many(api: Callable[..., APIClient], world: World) -> None:
    one = submit(api("bob"), {"compute_resource": "Research: 4 GPUs", "name": "resnet", "project": "apollo"})
    assert one.status_code == 201, one.content
    body = one.json()
    assert (body["state"], body["gpus"], body["project"], body["submitter"]) == (
        "queued",
        "4",
        "apollo",
        "bob",
    )
    many = submit(
        api("bob"),
        [
            {"compute_resource": "Research: shared GPU", "gpus": "0.25"},
            {"compute_resource": "Research: MIG slice"},
            {"compute_resource": "Research: multi-node training"},
        ],
    )
    assert many.status_code == 201, many.content
    sizes = [(task["gpus"], task["nodes"], task["sharing"]) for task in many.json()]
    assert sizes == [("1/4", 1, "fraction"), ("1/7", 1, "mig"), ("8", 2, "whole")]


def test_a_batch_is_all_or_none_and_names_the_bad_one(api: Callable[..., APIClient], world: World) -> None:
    before = api("bob").get("/api/v1/tasks/?mine=true").json()["count"]
    response = submit(
        api("bob"),
        [{"compute_resource": "Research: 4 GPUs"}, {"compute_resource": "Research: shared GPU", "gpus": "2"}],
    )
    assert response.status_code == 400
    assert response.json()["detail"].startswith(
        "Task 1: Research: shared GPU runs tasks of 0.25 GPU to 0.5 GPU"
    )
    assert list(response.json()["errors"]) == ["1.gpus"]
    assert api("bob").get("/api/v1/tasks/?mine=true").json()["count"] == before


def test_a_large_batch_reads_each_queue_and_project_it_names_once(
    api: Callable[..., APIClient], world: World
) -> None:
    """What a submission checks per compute resource and project (open to the user, a member, where it
    may run) is read once per pair it names, not once per task: a thousand tasks cost what ten do."""

    def queries(count: int) -> int:
        batch = [{"compute_resource": "Research: 4 GPUs", "project": "apollo"}] * count
        with CaptureQueriesContext(connection) as captured:
            assert submit(api("bob"), batch).status_code == 201
        return len(captured.captured_queries)

    few, many = queries(10), queries(200)
    assert many - few <= 2  # the inserts may take one more statement each; the checks none


@pytest.mark.parametrize(
    ("second", "fragment"),
    [
        ({"compute_resource": "Dev: 4 GPUs"}, "Task 2: No compute resource 'Dev: 4 GPUs' is open to bob"),
        (
            {"compute_resource": "Research: 4 GPUs", "project": "hermes"},
            "Task 2: bob is not a member of a project 'hermes'",
        ),
        (
            {"compute_resource": "Research: 4 GPUs", "gpus": "8"},
            "Task 2: Research: 4 GPUs runs tasks of exactly",
        ),
    ],
)
def test_each_pair_in_a_batch_is_checked_on_its_own(
    api: Callable[..., APIClient], world: World, second: dict[str, str], fragment: str
) -> None:
    batch = [{"compute_resource": "Research: 4 GPUs", "project": "apollo"}] * 2 + [second]
    response = submit(api("bob"), batch)
    assert response.status_code == 400
    assert response.json()["detail"].startswith(fragment)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"compute_resource": "Research: shared GPU", "gpus": "0"}, "more than 0"),
        ({"compute_resource": "Research: shared GPU", "gpus": "-1"}, "from 0 to 1,000,000"),
        ({"compute_resource": "Research: shared GPU", "gpus": "0.75"}, "runs tasks of 0.25 GPU to 0.5 GPU"),
        ({"compute_resource": "Research: shared GPU"}, "give gpus between 0.25 GPU and 0.5 GPU"),
        ({"compute_resource": "Research: 4 GPUs", "gpus": "8"}, "runs tasks of exactly 4 GPUs"),
        ({"compute_resource": "Research: 4 GPUs", "gpus": "1.001"}, "cannot be counted exactly"),
        ({"compute_resource": "Nowhere: 4 GPUs"}, "No compute resource 'Nowhere: 4 GPUs' is open to bob"),
        ({"compute_resource": "Dev: 4 GPUs"}, "No compute resource 'Dev: 4 GPUs' is open to bob"),
        ({"compute_resource": "Research: 4 GPUs", "project": "hermes"}, "not a member of a project 'hermes'"),
    ],
)
def test_what_could_never_run_is_refused_at_submit(
    api: Callable[..., APIClient], world: World, body: dict[str, str], fragment: str
) -> None:
    response = submit(api("bob"), body)
    assert response.status_code == 400, response.content
    assert fragment in response.json()["detail"]
    assert response.json()["errors"]


def test_limits_and_shares_are_named_when_a_size_breaks_them(
    api: Callable[..., APIClient], world: World
) -> None:
    with schema_context("acme"):
        ResourcePolicy.objects.filter(name="research").update(limit_units=2 * 840)
    response = submit(api("bob"), {"compute_resource": "Research: 4 GPUs"})
    assert "above the limit of policy research, 2 GPUs" in response.json()["detail"]
    with schema_context("acme"):
        ResourcePolicy.objects.filter(name="research").update(limit_units=16 * 840)
    Tenant.objects.filter(pk=world.tenant_a.pk).update(gpu_share=2)
    response = submit(api("bob"), {"compute_resource": "Research: 4 GPUs"})
    assert "above the tenant's GPU share of 2" in response.json()["detail"]


def test_viewers_cannot_submit_and_only_the_submitter_or_an_admin_cancels(
    api: Callable[..., APIClient], world: World
) -> None:
    assert submit(api("dave"), {"compute_resource": "Research: 4 GPUs"}).status_code == 403
    refused = api("carol").post(f"/api/v1/tasks/{world.task_a}/cancel/")
    assert refused.status_code == 403
    assert "submitter or a tenant admin" in refused.json()["detail"]
    cancelled = api("alice").post(f"/api/v1/tasks/{world.task_a}/cancel/")
    assert (cancelled.status_code, cancelled.json()["state"]) == (200, "aborted")
    again = api("bob").post(f"/api/v1/tasks/{world.task_a}/cancel/")
    assert again.status_code == 400
    assert "already ended" in again.json()["detail"]


def test_why_gives_the_reason_and_the_position(api: Callable[..., APIClient], world: World) -> None:
    bob = api("bob")
    for index in range(5):  # 4 GPUs each: 16 GPUs fill both pools, and the research limit of 16
        submit(bob, {"compute_resource": "Research: 4 GPUs", "name": f"fill-{index}"})
    late = submit(bob, {"compute_resource": "Research: 4 GPUs", "name": "late"}).json()
    urgent = submit(bob, {"compute_resource": "Research: 4 GPUs", "name": "urgent", "priority": 5}).json()
    before = bob.get(f"/api/v1/tasks/{late['id']}/why/").json()
    assert before["reason"] == "Waiting for the next scheduling cycle."
    with schema_context("acme"):
        result = run_cycle(world.tenant_a)
    assert result.placed == 4
    why = bob.get(f"/api/v1/tasks/{late['id']}/why/").json()
    assert why["state"] == "queued"
    assert why["reason_code"] == "policy_limit"
    assert "Policy research is at its limit of 16 GPUs" in why["reason"]
    # Placed: urgent (priority 5), then by submit time the world's first task and fill-0, fill-1.
    assert why["position"] == 4  # behind fill-2, fill-3 and fill-4
    assert bob.get(f"/api/v1/tasks/{urgent['id']}/").json()["state"] == "placed"
    history = bob.get(f"/api/v1/tasks/{urgent['id']}/history/").json()
    assert [(event["from_state"], event["to_state"], event["actor"]) for event in history] == [
        ("", "queued", "bob"),
        ("queued", "placed", "scheduler"),
    ]


def test_tasks_can_be_filtered(api: Callable[..., APIClient], world: World) -> None:
    submit(api("bob"), {"compute_resource": "Research: shared GPU", "gpus": "0.5", "project": "apollo"})
    client = api("dave")
    assert client.get("/api/v1/tasks/?state=queued").json()["count"] == 2
    assert client.get("/api/v1/tasks/?compute_resource=Research: shared GPU").json()["count"] == 1
    assert client.get("/api/v1/tasks/?project=apollo").json()["count"] == 1
    assert client.get("/api/v1/tasks/?mine=true").json()["count"] == 0
    bad = client.get("/api/v1/tasks/?state=sleeping")
    assert bad.status_code == 400
    assert "Unknown state" in bad.json()["detail"]


def test_compute_resources_say_which_are_open_and_how_they_wait(
    api: Callable[..., APIClient], world: World
) -> None:
    with schema_context("acme"):
        run_cycle(world.tenant_a)
    listed = {row["name"]: row for row in api("bob").get("/api/v1/compute-resources/").json()["results"]}
    research = listed["Research: 4 GPUs"]
    assert research["open_to_you"] is True
    assert listed["Dev: 4 GPUs"]["open_to_you"] is False
    assert (research["reservation_gpus"], research["limit_gpus"], research["size"]) == ("8", "16", "4 GPUs")
    assert research["active"] == 1
    assert research["wait_p50_seconds"] is not None
    waits = api("dave").get("/api/v1/queue-wait/?by=group").json()
    assert waits["research"]["placed"] == 1
    assert api("dave").get("/api/v1/queue-wait/?by=colour").status_code == 400


def test_queue_wait_and_depth_are_in_metrics(api: Callable[..., APIClient], world: World) -> None:
    from apps.scheduling import metrics

    submit(api("bob"), {"compute_resource": "Research: 4 GPUs"})
    with schema_context("acme"):
        run_cycle(world.tenant_a)
    metrics.CACHE_SECONDS = 0.0
    text = APIClient().get("/metrics").content.decode()
    assert (
        'klique_queue_wait_seconds{compute_resource="Research: 4 GPUs",quantile="0.95",tenant="acme"}' in text
    )
    assert 'klique_group_queue_wait_seconds{group="research",quantile="0.5",tenant="acme"}' in text
    assert 'klique_queue_tasks{compute_resource="Research: 4 GPUs",state="active",tenant="acme"} 2.0' in text


def test_a_size_no_pool_of_the_profile_holds_is_refused(api: Callable[..., APIClient], world: World) -> None:
    with schema_context("acme"):
        from apps.resources.models import Pool

        Pool.objects.filter(name="baremetal").update(capacity_gpus=2)
        Pool.objects.filter(name="h100").update(capacity_gpus=2)
    response = submit(api("bob"), {"compute_resource": "Research: 4 GPUs"})
    assert response.status_code == 400
    assert (
        "4 GPUs is more than any pool of Research: 4 GPUs holds (the largest has 2 GPUs)"
        in response.json()["detail"]
    )


def test_an_idempotency_key_sent_again_returns_the_task_it_made(
    api: Callable[..., APIClient], world: World
) -> None:
    body = {"compute_resource": "Research: 4 GPUs", "name": "once", "idempotency_key": "run-42"}
    first = submit(api("bob"), body)
    assert first.status_code == 201, first.content
    before = api("bob").get("/api/v1/tasks/?mine=true").json()["count"]
    for again in (body, {**body, "name": "renamed"}, [body, {"compute_resource": "Research: 4 GPUs"}]):
        answer = submit(api("bob"), again)
        assert answer.status_code == 201, answer.content
        returned = answer.json()[0] if isinstance(again, list) else answer.json()
        assert returned["id"] == first.json()["id"]
        assert returned["name"] == "once"  # the task the key made, as it was made
    assert api("bob").get("/api/v1/tasks/?mine=true").json()["count"] == before + 1  # only the unkeyed one
    # The key is the submitter's own: another person's same key makes their own task.
    other = submit(api("alice"), body)
    assert other.status_code == 201
    assert other.json()["id"] != first.json()["id"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ([{"compute_resource": "Research: 4 GPUs", "idempotency_key": "k"}] * 2, "share an idempotency key"),
        ({"compute_resource": "Research: 4 GPUs", "idempotency_key": "k" * 101}, "no more than 100"),
    ],
)
def test_idempotency_keys_out_of_form_are_refused(
    api: Callable[..., APIClient], world: World, body: object, fragment: str
) -> None:
    before = api("bob").get("/api/v1/tasks/?mine=true").json()["count"]
    answer = submit(api("bob"), body)
    assert answer.status_code == 400
    assert fragment in str(answer.json())
    assert api("bob").get("/api/v1/tasks/?mine=true").json()["count"] == before


def test_a_key_another_submission_used_between_the_look_and_the_insert_returns_that_task(
    world: World, db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two submissions racing with one key: the other commits after this one looked for the key and
    before it inserted. The unique constraint refuses the second row; the submission returns the first."""

    tenant = Tenant.objects.get(schema_name=world.tenant_a.schema_name)
    with schema_context(tenant.schema_name):
        bob = User.objects.get(username="bob")
        request = services.TaskRequest(compute_resource="Research: 4 GPUs", idempotency_key="race")
        (theirs,) = services.tasks_submit(tenant=tenant, user=bob, requests=[request])
        looked = services._made_before
        calls = []

        def missed_it(user: User, requests: list[services.TaskRequest]) -> dict[str, Task]:
            calls.append(1)
            return {} if len(calls) == 1 else looked(user, requests)  # the first look came too early

        monkeypatch.setattr(services, "_made_before", missed_it)
        (mine,) = services.tasks_submit(tenant=tenant, user=bob, requests=[request])
        assert mine.pk == theirs.pk
        assert Task.objects.filter(submitter=bob, idempotency_key="race").count() == 1
