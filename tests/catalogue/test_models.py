"""Model endpoints: an app whose template `serves` a model is a deployment of that model in the tenant's
gateway while it runs, for the people the app is shared with only; idleness puts it to sleep (scaling to
zero) or takes it out, as its template says; a call to a sleeping model starts its app again. Nobody's
app can stand in for a model another person serves, or one the administrator configured."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.catalogue import services
from apps.catalogue.models import AppInstance, CatalogueEntry
from apps.core.errors import InvalidInput
from apps.scheduling.models import Task, TaskState
from gateway import services as gateway
from gateway.models import SelfHosted
from protocol.apps import Template, TemplateInvalid
from tests.world import World

pytestmark = pytest.mark.django_db

MODEL_ENTRY: dict[str, Any] = {
    "name": "tiny-llm",
    "version": "1",
    "kind": "model",
    "command": ["serve", "--port={port}"],
    "health": {"path": "/health", "startup_seconds": 120},
    "gpus": "4",
    "compute_resource": "Research: 4 GPUs",
    "variables": [{"name": "SERVED_NAME", "default": "tiny"}],
    "serves": {"model_variable": "SERVED_NAME", "mode": "chat", "input_cost_per_million": 0.5},
    "idle_timeout_seconds": 600,
}


def launch_model(world: World, persona: str = "bob", served: str = "tiny", **options: Any) -> AppInstance:
    tenant = world.tenant_a
    with schema_context(tenant.schema_name):
        if not CatalogueEntry.objects.filter(name="tiny-llm").exists():
            services.entry_add(user=User.objects.get(username="alice"), document=MODEL_ENTRY)
        user = User.objects.get(username=persona)
        return services.app_launch(
            tenant=tenant, user=user, entry="tiny-llm", variables={"SERVED_NAME": served}, **options
        )


def deployments(world: World) -> dict[str, Any]:
    config, _, _ = gateway.config_load(world.tenant_a.schema_name)
    return {d.id: d for d in config.deployments if d.app}


def names(world: World, persona: str) -> list[str]:
    config, _, _ = gateway.config_load(world.tenant_a.schema_name)
    with schema_context(world.tenant_a.schema_name):
        return config.model_names_for(str(User.objects.get(username=persona).pk))


def run_with_tunnel(
    app: AppInstance, channel: str = "tunnel-1", *, idle_for: timedelta | None = None
) -> None:
    """As if its agent ran it and opened its tunnel (`idle_for` ago)."""
    now = timezone.now()
    Task.objects.filter(pk=str(app.task_id)).update(state=TaskState.RUNNING)
    AppInstance.objects.filter(pk=app.pk).update(
        tunnel_channel=channel,
        ready_at=now - timedelta(hours=2),
        last_request_at=now - (idle_for or timedelta()),
    )
    gateway.selfhosted_set(app.pk, state="ready", channel=channel)


@pytest.mark.parametrize(
    ("serves", "problem"),
    [
        ("vllm", "serves: an object"),
        ({}, "serves: name the model with exactly one of model and model_variable."),
        ({"model": "a", "model_variable": "SERVED_NAME"}, "exactly one of model and model_variable"),
        ({"model_variable": "NOPE"}, "serves.model_variable: one of the template's variables (SERVED_NAME)."),
        ({"model": "../etc"}, "serves.model: up to 100 letters"),
        ({"model": "has space"}, "serves.model: up to 100 letters"),
        ({"model": "m", "mode": "image"}, "serves.mode: one of chat, completion, embedding."),
        ({"model": "m", "when_idle": "sleep"}, "serves.when_idle: one of stop, scale_to_zero."),
        ({"model": "m", "input_cost_per_million": -1}, "serves.input_cost_per_million: USD per million"),
        ({"model": "m", "output_cost_per_million": "1"}, "serves.output_cost_per_million: USD per million"),
        ({"model": "m", "api_base": "http://169.254.169.254/"}, "serves.api_base: not a field of serves"),
    ],
)
def test_a_serves_section_that_does_not_validate_is_refused_by_its_path(serves: Any, problem: str) -> None:
    with pytest.raises(TemplateInvalid) as refused:
        Template.parse({**MODEL_ENTRY, "serves": serves})
    assert any(problem in line for line in refused.value.problems), refused.value.problems


@pytest.mark.parametrize("served", ["", "two words", "-leading", "x" * 101, "a\nb", "é"])
def test_a_model_name_from_a_variable_must_be_a_model_name(served: str) -> None:
    template = Template.parse(MODEL_ENTRY)
    with pytest.raises(TemplateInvalid) as refused:
        template.values({"SERVED_NAME": served})
    assert any(line.startswith("variables.SERVED_NAME: ") for line in refused.value.problems)


def test_the_shipped_model_entries_serve_their_served_name() -> None:
    from apps.catalogue.shipped import TEMPLATES

    for name in ("vllm", "sglang", "llama-cpp"):
        serves = TEMPLATES[name].serves
        assert serves is not None
        assert (serves.model_variable, serves.mode, serves.when_idle) == (
            "SERVED_NAME",
            "chat",
            "scale_to_zero",
        )
        assert TEMPLATES[name].serves == Template.parse(TEMPLATES[name].as_json()).serves  # kept in a copy


def test_a_launched_model_is_a_deployment_for_those_the_app_is_shared_with(world: World) -> None:
    private = launch_model(world, "bob", served="bobs-model")
    shared = launch_model(world, "bob", served="apollo-model", project="apollo", share_with_project=True)
    grouped = launch_model(world, "alice", served="dev-model", groups=["dev"])
    found = deployments(world)
    assert set(found) == {
        f"bobs-model#app-{private.pk}",
        f"apollo-model#app-{shared.pk}",
        f"dev-model#app-{grouped.pk}",
    }
    deployment = found[f"bobs-model#app-{private.pk}"]
    assert (deployment.model, deployment.mode, deployment.app) == ("bobs-model", "chat", str(private.pk))
    assert str(deployment.input_cost_per_million) == "0.500000"
    assert names(world, "bob") == ["apollo-model", "bobs-model"]  # his own, and his project's
    assert names(world, "carol") == ["apollo-model", "dev-model"]  # her project's, and her group's
    # A tenant admin reaches only the apps shared with her (she made apollo): not bob's own.
    assert names(world, "alice") == ["apollo-model", "dev-model"]
    assert names(world, "dave") == []


def test_nobody_stands_in_for_a_model_someone_else_serves_or_the_gateway_configures(world: World) -> None:
    launch_model(world, "bob", served="shared-name")
    with pytest.raises(InvalidInput, match="Another person's app serves 'shared-name'"):
        launch_model(world, "alice", served="shared-name")
    again = launch_model(world, "bob", served="shared-name")  # a second replica of his own: both serve
    assert len([d for d in deployments(world).values() if d.model_name == "shared-name"]) == 2
    assert again.pk
    with schema_context(world.tenant_a.schema_name):
        alice = User.objects.get(username="alice")
        gateway.settings_save(
            user=alice,
            document={
                "model_list": [{"model_name": "gpt-small", "litellm_params": {"model": "openai/gpt-4o-mini"}}]
            },
        )
    with pytest.raises(InvalidInput, match="'gpt-small' is a model the tenant's gateway configures"):
        launch_model(world, "bob", served="gpt-small")
    mine = launch_model(world, "alice", served="gpt-small")  # a tenant admin's app may join the group
    assert f"gpt-small#app-{mine.pk}" in deployments(world)
    with schema_context(world.tenant_a.schema_name):  # the refused launches left nothing behind
        assert AppInstance.objects.filter(entry_name="tiny-llm").count() == 3
        assert Task.objects.filter(name="app tiny-llm").count() == 3


def test_a_model_app_joins_leaves_and_sleeps_as_it_runs_stops_and_idles(world: World) -> None:
    tenant = world.tenant_a
    app = launch_model(world, "bob")
    with schema_context(tenant.schema_name):
        assert SelfHosted.objects.get(app_id=app.pk).state == "starting"
        run_with_tunnel(app, idle_for=timedelta(minutes=11))
        # A call through the gateway a minute ago keeps it: the route is not the only traffic.
        SelfHosted.objects.filter(app_id=app.pk).update(last_call_at=timezone.now() - timedelta(minutes=1))
        assert services.apps_reclaim_idle(tenant=tenant) == []
        SelfHosted.objects.filter(app_id=app.pk).update(last_call_at=timezone.now() - timedelta(minutes=11))
        assert [stopped.pk for stopped in services.apps_reclaim_idle(tenant=tenant)] == [app.pk]
        row = SelfHosted.objects.get(app_id=app.pk)
        assert (row.state, row.channel) == ("asleep", "")  # listed still; its GPUs went back
        task = Task.objects.get(pk=str(app.task_id))
        assert task.state == TaskState.ABORTED
        assert "The next call to its model through the gateway starts it again." in task.reason
    assert "tiny" in names(world, "bob")
    with schema_context(tenant.schema_name):
        woken = services.app_wake(tenant=tenant, app_id=str(app.pk))
        assert woken is not None
        assert woken.task_id != task.pk
        assert Task.objects.get(pk=str(woken.task_id)).state == TaskState.QUEUED
        assert SelfHosted.objects.get(app_id=app.pk).state == "starting"
        twice = services.app_wake(tenant=tenant, app_id=str(app.pk))
        assert twice is not None
        assert twice.task_id == woken.task_id  # started once
        run_with_tunnel(woken, "tunnel-2")
        services.tunnel_closed(app_id=app.pk, channel="tunnel-1")  # an old tunnel's close changes nothing
        assert SelfHosted.objects.get(app_id=app.pk).channel == "tunnel-2"
        services.tunnel_closed(app_id=app.pk, channel="tunnel-2")
        assert SelfHosted.objects.get(app_id=app.pk).channel == ""
        services.app_stop(tenant=tenant, user=User.objects.get(username="bob"), app=woken)
        assert not SelfHosted.objects.filter(app_id=app.pk).exists()  # its owner stopped it: it left
        assert services.app_wake(tenant=tenant, app_id=str(app.pk)) is None
    assert names(world, "bob") == []


def test_a_model_that_stops_when_idle_leaves_and_a_sleeping_one_leaves_when_stopped(world: World) -> None:
    tenant = world.tenant_a
    with schema_context(tenant.schema_name):
        services.entry_add(
            user=User.objects.get(username="alice"),
            document={**MODEL_ENTRY, "name": "stops", "serves": {"model": "stopper", "when_idle": "stop"}},
        )
        bob = User.objects.get(username="bob")
        stopping = services.app_launch(tenant=tenant, user=bob, entry="stops")
        run_with_tunnel(stopping, idle_for=timedelta(hours=1))
        sleeper = launch_model(world, "bob", served="sleeper")
        run_with_tunnel(sleeper, "tunnel-s", idle_for=timedelta(hours=1))
        assert len(services.apps_reclaim_idle(tenant=tenant)) == 2
        assert list(SelfHosted.objects.values_list("model_name", "state")) == [("sleeper", "asleep")]
        assert "Start it again from its address." in Task.objects.get(pk=str(stopping.task_id)).reason
        services.app_stop(tenant=tenant, user=bob, app=sleeper)  # a sleeping model: out of the gateway
        assert not SelfHosted.objects.exists()
        with pytest.raises(InvalidInput, match="is stopped already"):
            services.app_stop(tenant=tenant, user=bob, app=sleeper)


def test_an_app_that_ended_on_its_own_takes_its_model_out_when_called(world: World) -> None:
    tenant = world.tenant_a
    app = launch_model(world, "bob")
    with schema_context(tenant.schema_name):
        run_with_tunnel(app)
        Task.objects.filter(pk=str(app.task_id)).update(state=TaskState.FAILED)
        assert services.app_wake(tenant=tenant, app_id=str(app.pk)) is None
        assert not SelfHosted.objects.filter(app_id=app.pk).exists()


def test_a_model_leaves_when_its_apps_task_ends_and_no_other_task_takes_it_out(world: World) -> None:
    from apps.scheduling.lifecycle import transition
    from apps.scheduling.services import TaskRequest, tasks_submit

    tenant = world.tenant_a
    app = launch_model(world, "bob")
    with schema_context(tenant.schema_name):
        run_with_tunnel(app)
        bob = User.objects.get(username="bob")
        # A task of bob's own whose spec names the app, as anyone may write: its end changes nothing.
        request = TaskRequest(
            compute_resource="Research: 4 GPUs",
            name="posing",
            spec={"command": ["x"], "app": {"instance": str(app.pk)}},
        )
        (posing,) = tasks_submit(tenant=tenant, user=bob, requests=[request])
        transition(posing, to_state=TaskState.ABORTED, actor="bob", ended_at=timezone.now())
        assert SelfHosted.objects.filter(app_id=app.pk).exists()
        # The app's own task exits: its model leaves the gateway at once.
        task = Task.objects.get(pk=str(app.task_id))
        transition(task, to_state=TaskState.FAILED, actor="agent", ended_at=timezone.now())
        assert not SelfHosted.objects.filter(app_id=app.pk).exists()
