"""An agent's message finds its task and its run in one round trip (selectors.pool_task_and_run), under the
rules pool_task and run_of apply one statement each: compared with them on every kind of id an agent may
send, and in every place a task may be."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django_tenants.utils import schema_context

from apps.fleet import dispatch
from apps.fleet.selectors import pool_task, pool_task_and_run, run_of
from apps.resources.models import Pool
from apps.scheduling.models import Task, TaskRun
from tests.fleet.test_fencing import second_task


def each_way(task_id: str, lease_id: str, pool: Pool) -> tuple[Any, Any]:
    """(the one-trip answer, the two-statement answer), as (task pk, run pk) pairs."""
    with transaction.atomic():
        task, run = pool_task_and_run(task_id, lease_id, pool)
        together = (task and task.pk, run and run.pk)
    with transaction.atomic():
        task = pool_task(task_id, pool)
        run = run_of(task, lease_id)
        apart = (task and task.pk, run and run.pk)
    return together, apart


def test_every_kind_of_id_finds_what_the_two_statements_found(fleet: dict[str, Any]) -> None:
    second = second_task(fleet)
    with schema_context("fleet"):
        h100, baremetal = Pool.objects.get(name="h100"), Pool.objects.get(name="baremetal")
        [one, two] = dispatch.dispatch(pool=h100, schema_name="fleet", agent_id="rack-1")
        # the second task waits in the queue again, its pool cleared, its run kept in h100
        Task.objects.filter(pk=two["task_id"]).update(pool=None, state="queued")
        cases = {
            "its own run": (one["task_id"], one["lease_id"]),
            "queued again, its run here": (two["task_id"], two["lease_id"]),
            "another task's lease": (one["task_id"], two["lease_id"]),
            "unknown lease": (one["task_id"], str(uuid.uuid4())),
            "malformed lease": (one["task_id"], "not-a-lease"),
            "empty lease": (one["task_id"], ""),
            "unknown task": (str(uuid.uuid4()), one["lease_id"]),
            "malformed task": ("1 OR 1=1", one["lease_id"]),
            "quote in the task": ("x'; DROP TABLE scheduling_task; --", one["lease_id"]),
        }
        answers = {
            (name, pool.name): each_way(task_id, lease_id, pool)
            for name, (task_id, lease_id) in cases.items()
            for pool in (h100, baremetal)
        }
        runs = {str(run.pk) for run in TaskRun.objects.filter(task_id__in=[fleet["task"], second])}
    connections.close_all()
    for case, (together, apart) in answers.items():
        assert together == apart, case
    found = {case: together for case, (together, _) in answers.items()}
    assert found[("its own run", "h100")] == (uuid.UUID(one["task_id"]), uuid.UUID(one["lease_id"]))
    assert found[("queued again, its run here", "h100")][1] == uuid.UUID(two["lease_id"])
    assert found[("its own run", "baremetal")] == (None, None)  # another pool's agent learns nothing
    assert found[("queued again, its run here", "baremetal")] == (None, None)
    assert found[("another task's lease", "h100")] == (uuid.UUID(one["task_id"]), None)
    assert {one["lease_id"], two["lease_id"]} <= runs


def test_a_message_reads_its_task_and_run_in_one_statement(fleet: dict[str, Any]) -> None:
    with schema_context("fleet"):
        h100 = Pool.objects.get(name="h100")
        one, *_ = dispatch.dispatch(pool=h100, schema_name="fleet", agent_id="rack-1")
        with CaptureQueriesContext(connection) as queries, transaction.atomic():
            pool_task_and_run(one["task_id"], one["lease_id"], h100)
    connections.close_all()
    [statement] = [query["sql"] for query in queries.captured_queries if "scheduling_" in query["sql"]]
    assert statement.count("FOR UPDATE") == 2
