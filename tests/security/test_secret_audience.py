"""Secrets reach only the tasks of their audience, never the platform's own, and what a task wrote is read
by its submitter, its project's members and tenant admins only, with known secret values masked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import Group, Project, User
from apps.fleet.dispatch import task_report
from apps.fleet.selectors import task_logs
from apps.scheduling.models import Task, TaskState
from apps.vault.models import Secret
from apps.vault.services import mask, secret_set, secret_values_for
from gateway import services as gateway_services
from tests.world import HOST_A, World

pytestmark = pytest.mark.django_db

RESOURCE = "Research: 4 GPUs"


def submit(client: APIClient, secrets: list[str], project: str | None = None) -> Any:
    body: dict[str, Any] = {"compute_resource": RESOURCE, "spec": {"command": ["true"], "secrets": secrets}}
    if project:
        body["project"] = project
    return client.post("/api/v1/tasks/", body, format="json")


def test_a_tenant_secret_goes_to_no_task_until_an_admin_grants_it(
    api: Callable[..., APIClient], world: World
) -> None:
    alice, bob = api("alice"), api("bob")
    kept = alice.post(
        "/api/v1/secrets/", {"scope": "tenant", "name": "DATASET_KEY", "value": "ds-1234"}, format="json"
    )
    assert kept.status_code == 201, kept.content
    assert kept.json()["audience"] == {"groups": [], "projects": []}
    refused = submit(bob, ["DATASET_KEY"])
    assert refused.status_code == 400
    assert "Tenant secret DATASET_KEY is not granted to your groups" in refused.json()["detail"]

    granted = alice.put(
        f"/api/v1/secrets/{kept.json()['id']}/", {"audience": {"groups": ["research"]}}, format="json"
    )
    assert granted.status_code == 200, granted.content
    assert granted.json()["audience"] == {"groups": ["research"], "projects": []}
    accepted = submit(bob, ["DATASET_KEY"])
    assert accepted.status_code == 201, accepted.content
    with schema_context("acme"):
        task = Task.objects.get(pk=accepted.json()["id"])
        assert secret_values_for(task) == {"DATASET_KEY": "ds-1234"}  # the value did not change
    assert submit(api("carol"), ["DATASET_KEY"]).status_code == 400


def test_a_tenant_secret_granted_to_a_project_goes_to_that_projects_tasks_only(
    api: Callable[..., APIClient], world: World
) -> None:
    alice, bob = api("alice"), api("bob")
    body = {"scope": "tenant", "name": "APOLLO_DB", "value": "db-pass", "audience": {"projects": ["apollo"]}}
    assert alice.post("/api/v1/secrets/", body, format="json").status_code == 201
    without = submit(bob, ["APOLLO_DB"])
    assert without.status_code == 400
    assert "not granted to your groups" in without.json()["detail"]
    assert submit(bob, ["APOLLO_DB"], project="apollo").status_code == 201


@pytest.mark.parametrize(
    "audience",
    [{"groups": ["no-such-group"]}, {"projects": ["no-such-project"]}, {"groups": "research"}],
)
def test_an_audience_names_groups_and_projects_that_exist(
    audience: dict[str, Any], api: Callable[..., APIClient], world: World
) -> None:
    body = {"scope": "tenant", "name": "X_KEY", "value": "v", "audience": audience}
    answer = api("alice").post("/api/v1/secrets/", body, format="json")
    assert answer.status_code == 400, answer.content
    with schema_context("acme"):
        assert not Secret.objects.filter(name="X_KEY").exists()


def test_only_tenant_secrets_have_an_audience_and_only_admins_set_it(
    api: Callable[..., APIClient], world: World
) -> None:
    own = {"name": "MINE_KEY", "value": "v", "audience": {"groups": ["research"]}}
    answer = api("bob").post("/api/v1/secrets/", own, format="json")
    assert answer.status_code == 400
    assert "Only tenant secrets have an audience" in answer.json()["detail"]
    answer = api("bob").put(
        f"/api/v1/secrets/{world.secret_a}/", {"audience": {"groups": ["research"]}}, format="json"
    )
    assert answer.status_code == 403


def _platform_names_in_use() -> None:
    with schema_context("acme"):
        alice = User.objects.get(username="alice")
        secret_set(user=alice, scope="tenant", name="SSO_CLIENT_SECRET", value="sso-client-value")
        secret_set(user=alice, scope="tenant", name="UPSTREAM_KEY", value="sk-upstream-value")
        document = {
            "model_list": [
                {
                    "model_name": "chat",
                    "litellm_params": {
                        "model": "openai/gpt-4o-mini",
                        "api_base": "https://llm.example/v1",
                        "api_key_secret": "UPSTREAM_KEY",
                    },
                }
            ]
        }
        gateway_services.settings_save(user=alice, document=document)


@pytest.mark.parametrize("name", ["SSO_CLIENT_SECRET", "UPSTREAM_KEY"])
def test_secrets_the_platform_reads_are_never_given_to_a_task(
    name: str, api: Callable[..., APIClient], world: World
) -> None:
    _platform_names_in_use()
    with schema_context("acme"):
        secret = Secret.objects.get(scope="tenant", name=name)
    granting = api("alice").put(
        f"/api/v1/secrets/{secret.pk}/", {"audience": {"groups": ["research"]}}, format="json"
    )
    assert granting.status_code == 400
    assert "used by the platform itself" in granting.json()["detail"]
    with schema_context("acme"):  # granted before the name came into use: still not a task's
        secret.audience_groups.add(Group.objects.get(name="research"))
    refused = submit(api("bob"), [name])
    assert refused.status_code == 400
    assert f"{name} is used by the platform itself" in refused.json()["detail"]
    with schema_context("acme"):
        bob = User.objects.get(username="bob")
        assert secret_values_for(Task(submitter=bob, spec={"secrets": []}, project=None)) == {}


def test_a_users_own_secret_of_the_same_name_is_theirs_to_use(
    api: Callable[..., APIClient], world: World
) -> None:
    _platform_names_in_use()
    bob = api("bob")
    assert (
        bob.post("/api/v1/secrets/", {"name": "UPSTREAM_KEY", "value": "bobs-own"}, format="json").status_code
        == 201
    )
    accepted = submit(bob, ["UPSTREAM_KEY"])
    assert accepted.status_code == 201, accepted.content
    with schema_context("acme"):
        assert secret_values_for(Task.objects.get(pk=accepted.json()["id"])) == {"UPSTREAM_KEY": "bobs-own"}


def test_another_users_or_projects_secret_is_not_found(api: Callable[..., APIClient], world: World) -> None:
    with schema_context("acme"):
        alice = User.objects.get(username="alice")
        secret_set(user=alice, scope="user", name="ALICES_OWN", value="a-1")
        hermes = Project.objects.create(name="hermes-acme")
        secret_set(user=alice, scope="project", project=hermes, name="HERMES_KEY", value="h-1")
    for name in ("ALICES_OWN", "HERMES_KEY"):
        refused = submit(api("bob"), [name], project="apollo")
        assert refused.status_code == 400
        assert f"No secret named {name}" in refused.json()["detail"]


# Who reads what a task wrote -----------------------------------------------------------------------------


def _task_in_apollo(world: World) -> Task:
    with schema_context("acme"):
        bob = User.objects.get(username="bob")
        first = Task.objects.get(pk=world.task_a)
        return Task.objects.create(
            name="apollo-run",
            compute_resource_id=world.compute_resource_a,
            compute_resource_name=RESOURCE,
            submitter=bob,
            project=Project.objects.get(name="apollo"),
            size_units=840,
            spec={"command": ["true"]},
            state=TaskState.QUEUED,
            submitted_at=first.submitted_at,
            queued_at=first.queued_at,
        )


@pytest.mark.parametrize(
    ("persona", "reads"),
    [("bob", True), ("carol", True), ("alice", True), ("dave", False)],  # submitter, project, admin, viewer
)
@pytest.mark.parametrize("what", ["logs/", "metrics/", "outputs/"])
def test_a_tasks_output_is_its_submitters_its_projects_and_the_admins(
    persona: str, reads: bool, what: str, api: Callable[..., APIClient], world: World
) -> None:
    task = _task_in_apollo(world)
    answer = api(persona).get(f"/api/v1/tasks/{task.pk}/{what}")
    if reads:
        assert answer.status_code == 200, answer.content
    else:
        assert answer.status_code == 403
        assert answer.json()["detail"] == (
            "Only bob, members of project apollo and tenant admins read what this task wrote."
        )
    assert api(persona).get(f"/api/v1/tasks/{task.pk}/").status_code == 200  # the task itself is the tenant's


def test_a_member_outside_the_project_cannot_read_it_either(
    api: Callable[..., APIClient], world: World
) -> None:
    with schema_context("acme"):
        erin = User.objects.create(username="erin", role="member")
        from apps.accounts.services import token_create

        token = token_create(tenant=world.tenant_a, user=erin, name="t").secret
    task = _task_in_apollo(world)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_HOST=HOST_A)
    assert client.get(f"/api/v1/tasks/{task.pk}/logs/").status_code == 403
    assert client.get(f"/api/v1/tasks/{world.task_a}/outputs/result.txt").status_code == 403


def test_the_portal_shows_the_output_only_to_those_who_read_it(world: World, client: Client) -> None:
    task = _task_in_apollo(world)
    with schema_context("acme"):
        for persona, shown in (("dave", False), ("carol", True)):
            client.force_login(User.objects.get(username=persona))
            page = client.get(f"/portal/tasks/{task.pk}/", HTTP_HOST=HOST_A).content.decode()
            assert ('data-follow="/ws/v1/tasks/' in page) is shown
            assert ("read what this task wrote" in page) is not shown


# Masking -------------------------------------------------------------------------------------------------


def test_known_secret_values_are_masked_in_stored_logs(world: World) -> None:
    with schema_context("acme"):
        bob = User.objects.get(username="bob")
        secret_set(user=bob, scope="user", name="HF_TOKEN", value="hf_abcdef123456")
        secret_set(
            user=bob,
            scope="user",
            name="PEM_KEY",
            value="-----BEGIN KEY-----\nMIIEsecretbody\n-----END KEY-----",
        )
        secret_set(user=bob, scope="user", name="SHORT", value="no")
        task = _task_in_apollo(world)
        Task.objects.filter(pk=task.pk).update(
            spec={"command": ["true"], "secrets": ["HF_TOKEN", "PEM_KEY", "SHORT"]}
        )
        task.refresh_from_db()
        lines = [
            "token is hf_abcdef123456 here",
            "twice: hf_abcdef123456hf_abcdef123456",
            "MIIEsecretbody",
            "no no no",  # a value under four characters is left alone: it would mask ordinary output
            "quoted: 'hf_abcdef123456'",
        ]
        task_report(
            tenant=world.tenant_a, task=task, source="agent", seq=1, kind="log", body={"lines": lines}
        )
        stored = task_logs(task)[0]["lines"]
    assert stored == [
        "token is *** here",
        "twice: ******",
        "***",
        "no no no",
        "quoted: '***'",
    ]
    assert "hf_abcdef123456" not in str(stored)


def test_masking_replaces_the_longest_value_first() -> None:
    assert mask(["abcdefgh and abcd"], ["abcd", "abcdefgh"]) == ["*** and ***"]
    assert mask(["nothing here", 7], ["secretvalue"]) == ["nothing here", 7]
