"""The vault: write-only secrets in three scopes, envelope encryption with rotation, and reads audited."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.test import override_settings
from django_tenants.utils import schema_context
from rest_framework.test import APIClient

from apps.accounts.models import Group, Project, User
from apps.audit.models import AuditEvent
from apps.fleet.dispatch import dispatch
from apps.resources.models import Pool
from apps.scheduling.models import Task, TaskState
from apps.vault import crypto
from apps.vault.models import DataKey, Secret
from apps.vault.services import secret_set, secret_values_for
from tests.world import SECRET_VALUE_A, World

pytestmark = pytest.mark.django_db


def test_values_go_in_and_never_come_out(api: Callable[..., APIClient], world: World) -> None:
    bob = api("bob")
    made = bob.post("/api/v1/secrets/", {"name": "WANDB_API_KEY", "value": "wandb-1234"}, format="json")
    assert made.status_code == 201, made.content
    assert "value" not in made.json()
    assert made.json()["scope"] == "user"
    for response in (bob.get("/api/v1/secrets/"), bob.get(f"/api/v1/secrets/{made.json()['id']}/")):
        assert b"wandb-1234" not in response.content
    with schema_context("acme"):
        stored = Secret.objects.get(pk=made.json()["id"])
        assert b"wandb-1234" not in bytes(stored.ciphertext)
        assert b"wandb-1234" not in bytes(DataKey.objects.get().wrapped)


def test_who_may_keep_which_secret_and_who_sees_its_name(api: Callable[..., APIClient], world: World) -> None:
    bob, carol, alice = api("bob"), api("carol"), api("alice")
    tenant_wide = bob.post("/api/v1/secrets/", {"scope": "tenant", "name": "X", "value": "1"}, format="json")
    assert tenant_wide.status_code == 403
    assert "Only tenant admins" in tenant_wide.json()["detail"]
    project = {"scope": "project", "project": "apollo", "name": "HF_TOKEN", "value": "hf_apollo"}
    assert bob.post("/api/v1/secrets/", project, format="json").status_code == 403  # a member of apollo
    assert carol.post("/api/v1/secrets/", project, format="json").status_code == 201  # its admin
    own = bob.post("/api/v1/secrets/", {"name": "MINE", "value": "bob-only"}, format="json").json()
    assert own["id"] not in [row["id"] for row in alice.get("/api/v1/secrets/").json()["results"]]
    assert alice.delete(f"/api/v1/secrets/{own['id']}/").status_code == 404  # not even an admin's to see
    assert api("dave").post("/api/v1/secrets/", {"name": "V", "value": "1"}, format="json").status_code == 403
    names = {(row["scope"], row["name"]) for row in bob.get("/api/v1/secrets/").json()["results"]}
    assert {("tenant", "SHARED_TOKEN"), ("project", "HF_TOKEN"), ("user", "MINE")} <= names


def test_a_task_gets_its_users_secret_before_its_projects_before_the_tenants(
    api: Callable[..., APIClient], world: World
) -> None:
    with schema_context("acme"):
        alice, bob = User.objects.get(username="alice"), User.objects.get(username="bob")
        apollo = Project.objects.get(name="apollo")
        secret_set(user=alice, scope="tenant", name="HF_TOKEN", value="tenant-hf")
        secret_set(user=alice, scope="project", project=apollo, name="HF_TOKEN", value="apollo-hf")
        secret_set(user=alice, scope="tenant", name="DATASET_KEY", value="tenant-dataset")
        secret_set(user=bob, scope="user", name="DATASET_KEY", value="bobs-dataset")
        research = Group.objects.get(name="research")  # a tenant secret goes to the tasks it is granted to
        Secret.objects.get(scope="tenant", name="SHARED_TOKEN").audience_groups.add(research)
    submitted = api("bob").post(
        "/api/v1/tasks/",
        {
            "compute_resource": "Research: 4 GPUs",
            "project": "apollo",
            "spec": {"command": ["true"], "secrets": ["HF_TOKEN", "DATASET_KEY", "SHARED_TOKEN"]},
        },
        format="json",
    )
    assert submitted.status_code == 201, submitted.content
    with schema_context("acme"):
        task = Task.objects.get(pk=submitted.json()["id"])
        assert secret_values_for(task) == {
            "HF_TOKEN": "apollo-hf",
            "DATASET_KEY": "bobs-dataset",
            "SHARED_TOKEN": SECRET_VALUE_A,
        }
        reads = AuditEvent.objects.filter(action="secret.read", detail__task=str(task.pk))
        assert sorted(event.target for event in reads) == [
            "secret project/apollo/HF_TOKEN",
            "secret tenant/SHARED_TOKEN",
            "secret user/bob/DATASET_KEY",
        ]
        assert {(event.actor, event.on_behalf_of) for event in reads} == {("scheduler", "bob")}
        assert all(SECRET_VALUE_A not in str(event.detail) for event in AuditEvent.objects.all())


def test_a_task_naming_a_secret_nobody_kept_is_refused_at_submission(api: Callable[..., APIClient]) -> None:
    refused = api("bob").post(
        "/api/v1/tasks/",
        {"compute_resource": "Research: 4 GPUs", "spec": {"command": ["true"], "secrets": ["NOPE"]}},
        format="json",
    )
    assert refused.status_code == 400
    assert "No secret named NOPE for you, your project or the tenant" in refused.json()["detail"]


def test_the_assign_message_carries_the_values_and_a_deleted_secret_fails_the_task(world: World) -> None:
    with schema_context("acme"):
        bob = User.objects.get(username="bob")
        pool = Pool.objects.get(name="h100")
        secret_set(user=bob, scope="user", name="ONE_OFF", value="one-off-value")
        research = Group.objects.get(name="research")
        Secret.objects.get(scope="tenant", name="SHARED_TOKEN").audience_groups.add(research)
        task = Task.objects.create(
            name="with-secret",
            compute_resource_id=world.compute_resource_a,
            compute_resource_name="Research: 4 GPUs",
            submitter=bob,
            size_units=840,
            spec={"command": ["true"], "secrets": ["ONE_OFF", "SHARED_TOKEN"]},
            state=TaskState.PLACED,
            pool=pool,
            submitted_at=Task.objects.get(pk=world.task_a).submitted_at,
            queued_at=Task.objects.get(pk=world.task_a).queued_at,
        )
        Task.objects.exclude(pk=task.pk).filter(state=TaskState.PLACED).update(
            state=TaskState.QUEUED, pool=None
        )
        [assign] = dispatch(pool=pool, schema_name="acme")
        assert assign["secrets"] == {"ONE_OFF": "one-off-value", "SHARED_TOKEN": SECRET_VALUE_A}
        assert "one-off-value" not in str(assign["spec"])

        Secret.objects.filter(name="ONE_OFF").delete()
        Task.objects.filter(pk=task.pk).update(state=TaskState.PLACED, lease_id=None)
        assert dispatch(pool=pool, schema_name="acme") == []
        task.refresh_from_db()
        assert (task.state, task.reason_code) == (TaskState.FAILED, "secret_missing")
        assert (
            task.reason
            == "Secret ONE_OFF was deleted after the task was submitted. Keep it again and resubmit the task."
        )


def test_rotating_the_master_key_keeps_every_secret_readable(world: World) -> None:
    first, second = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    with schema_context("acme"):
        bob = User.objects.get(username="bob")
        DataKey.objects.all().delete()  # this test's tenant key starts under `first`
        Secret.objects.all().delete()
        with override_settings(KLIQUE_MASTER_KEYS=[first]):
            kept = secret_set(user=bob, scope="user", name="ROTATED", value="before-rotation")
            assert DataKey.objects.get().master_key_id == crypto.key_id(first)
        with (
            override_settings(KLIQUE_MASTER_KEYS=[second]),  # the old key dropped too early
            pytest.raises(crypto.VaultKeyError, match="put the previous key back"),
        ):
            secret_set(user=bob, scope="user", name="OTHER", value="x")
        with override_settings(KLIQUE_MASTER_KEYS=[second, first]):
            said = io.StringIO()
            call_command("vault_rotate", stdout=said)
            assert "data keys re-wrapped with master key" in said.getvalue()
            assert DataKey.objects.get().master_key_id == crypto.key_id(second)
        with override_settings(KLIQUE_MASTER_KEYS=[second]):  # now the old key may go
            task = Task(submitter=bob, spec={"secrets": ["ROTATED"]}, project=None)
            task.pk = kept.pk
            assert secret_values_for(task) == {"ROTATED": "before-rotation"}


def test_a_ciphertext_moved_to_another_secret_does_not_open(world: World) -> None:
    with schema_context("acme"):
        alice = User.objects.get(username="alice")
        one = secret_set(user=alice, scope="user", name="ONE", value="first")
        two = secret_set(user=alice, scope="user", name="TWO", value="second")
        Secret.objects.filter(pk=two.pk).update(ciphertext=bytes(one.ciphertext))
        task = Task(submitter=alice, spec={"secrets": ["TWO"]}, project=None)
        with pytest.raises(InvalidTag):
            secret_values_for(task)


def test_admins_read_the_audit_log_of_changes_made_through_the_api(api: Callable[..., APIClient]) -> None:
    alice = api("alice")
    alice.post(
        "/api/v1/secrets/", {"scope": "tenant", "name": "AUDITED", "value": "v-audited"}, format="json"
    )
    alice.post("/api/v1/configuration/draft/validate/")
    events = alice.get("/api/v1/audit/", {"actor": "alice"}).json()["results"]
    actions = [event["action"] for event in events]
    assert "secret.written" in actions
    assert "secret-list.post" in actions
    assert "configuration-validate.post" in actions
    assert all("v-audited" not in str(event) for event in events)
    assert api("bob").get("/api/v1/audit/").status_code == 403
