"""A pool's placed tasks are handed to an agent together: one statement numbers their attempts, and their
runs, their events and the tasks are written in one message (one INSERT each for the runs and the events),
however many there are."""

from __future__ import annotations

from typing import Any

from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django_tenants.utils import schema_context

from apps.fleet import dispatch
from apps.resources.models import Pool
from apps.scheduling.models import Task, TaskEvent, TaskRun, TaskState
from tests.fleet.test_fencing import second_task


def test_placed_tasks_are_dispatched_in_one_statement_per_table(fleet: dict[str, Any]) -> None:
    second = second_task(fleet)
    with schema_context("fleet"):
        pool = Pool.objects.get(name="h100")
        with CaptureQueriesContext(connection) as queries:
            assigned = dispatch.dispatch(pool=pool, schema_name="fleet", agent_id="rack-1")
        written = [q["sql"] for q in queries if q["sql"].startswith(("INSERT", "UPDATE"))]
        assert len(written) == 1  # one message
        writes = [sql.split(" (")[0].split(" SET")[0] for sql in written[0].split("; ")]
        tasks = {str(task.pk): task for task in Task.objects.filter(pk__in=[fleet["task"], second])}
        runs = {str(run.task_id): run for run in TaskRun.objects.filter(task__in=tasks.values())}
        events = list(TaskEvent.objects.filter(task__in=tasks.values(), to_state=TaskState.DISPATCHING))
    connections.close_all()
    assert writes == [
        'INSERT INTO "scheduling_taskrun"',
        'INSERT INTO "scheduling_taskevent"',
        'UPDATE "scheduling_task"',
        'UPDATE "scheduling_task"',
    ]
    # The look for placed work, BEGIN, the placed tasks, their attempts, the writes, COMMIT.
    assert len(queries) == 6
    assert sorted(message["task_id"] for message in assigned) == sorted(tasks)
    for message in assigned:
        task, run = tasks[message["task_id"]], runs[message["task_id"]]
        assert task.state == TaskState.DISPATCHING
        assert str(task.lease_id) == message["lease_id"] == str(run.pk)
        assert task.lease_expires_at is not None
        assert (run.attempt, run.agent_id, run.pool_id) == (1, "rack-1", pool.pk)
        assert message["attempt"] == 1
    assert sorted(event.message.split(",")[0] for event in events) == ["attempt 1", "attempt 1"]
    assert all(event.message.endswith("agent rack-1") for event in events)
