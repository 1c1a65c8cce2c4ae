"""The migration that gives back the specs saved as JSON strings (scheduling 0014) repairs exactly those:
a string holding an object's JSON becomes that object; any other spec is left as it is."""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest
from django.db import connection
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.scheduling.models import Task
from apps.scheduling.services import TaskRequest, tasks_submit
from tests.world import World

pytestmark = pytest.mark.django_db
repair = importlib.import_module("apps.scheduling.migrations.0014_task_spec_repair").repair


def test_a_spec_saved_as_its_json_text_is_given_back_and_nothing_else_changes(world: World) -> None:
    written = {
        "saved as text": json.dumps(json.dumps({"command": ["python", "train.py"], "secrets": ["HF_TOKEN"]})),
        "a string, not an object's JSON": json.dumps("hello"),
        "a string of a list": json.dumps("[1, 2]"),
        "an object": json.dumps({"command": ["true"]}),
    }
    with schema_context(world.tenant_a.schema_name):
        bob = User.objects.get(username="bob")
        tasks = tasks_submit(
            tenant=world.tenant_a,
            user=bob,
            requests=[TaskRequest(compute_resource="Research: 4 GPUs", name=name) for name in written],
        )
        with connection.cursor() as cursor:
            for task, text in zip(tasks, written.values(), strict=True):
                cursor.execute("UPDATE scheduling_task SET spec = %s::jsonb WHERE id = %s", [text, task.pk])
        repair(None, SimpleNamespace(connection=connection))
        specs = {task.name: Task.objects.get(pk=task.pk).spec for task in tasks}
    assert specs == {
        "saved as text": {"command": ["python", "train.py"], "secrets": ["HF_TOKEN"]},
        "a string, not an object's JSON": "hello",
        "a string of a list": "[1, 2]",
        "an object": {"command": ["true"]},
    }
