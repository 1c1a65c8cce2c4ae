"""Writes nobody waits for ride with the statement after them (apps.core.deferred): the same rows in the
database, in the same order, in fewer round trips; nothing of them where the block fails."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.core import deferred
from apps.fleet.selectors import pool_task_and_run
from apps.resources.models import Pool
from apps.scheduling.models import RunOutcome, Task, TaskEvent, TaskRun
from tests.world import World

pytestmark = pytest.mark.django_db


@pytest.fixture
def task(world: World) -> Iterator[Task]:
    with schema_context("acme"):
        yield Task.objects.get(pk=world.task_a)


def event(task: Task, message: str) -> TaskEvent:
    return TaskEvent(
        task=task, at=timezone.now(), actor="test", from_state="queued", to_state="queued", message=message
    )


def messages(task: Task) -> list[str]:
    return list(
        TaskEvent.objects.filter(task=task, actor="test").order_by("id").values_list("message", flat=True)
    )


def test_outside_a_block_each_write_is_sent_at_once(task: Task) -> None:
    with CaptureQueriesContext(connection) as queries:
        deferred.insert(event(task, "one"))
        task.reason = "now"
        deferred.update_fields(task, ["reason"])
    assert len(queries) == 2
    assert messages(task) == ["one"]
    assert Task.objects.get(pk=task.pk).reason == "now"


def test_kept_writes_ride_with_the_next_statement_which_sees_them(task: Task) -> None:
    with transaction.atomic(), deferred.writes_deferred():
        with CaptureQueriesContext(connection) as queries:
            deferred.insert(event(task, "one"))
            task.reason, task.priority = "kept", 7
            deferred.update_fields(task, ["reason", "priority"])
            deferred.insert(event(task, "two"))
        assert len(queries) == 0  # nothing sent yet
        with CaptureQueriesContext(connection) as queries:
            read = Task.objects.get(pk=task.pk)  # the ORM's own statement carries them
            assert messages(task) == ["one", "two"]
        assert (read.reason, read.priority) == ("kept", 7)
        assert len(queries) == 2
        assert queries[0]["sql"].count(";") == 3  # three writes, then the read, in one message


def test_the_carrying_statement_gets_its_own_result(task: Task) -> None:
    with transaction.atomic(), deferred.writes_deferred():
        deferred.insert(event(task, "one"))
        assert Task.objects.filter(pk=task.pk).update(reason="counted") == 1  # its rowcount, not the insert's
        deferred.insert(event(task, "two"))
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM scheduling_taskevent WHERE actor = %s", ["test"])
            assert cursor.fetchone() == (2,)
        deferred.insert(event(task, "three"))
        assert list(Task.objects.filter(pk=task.pk).values_list("reason", flat=True)) == ["counted"]


def test_a_statement_of_two_carries_them_and_still_reads_its_second_result(world: World, task: Task) -> None:
    """pool_task_and_run sends two statements in one message and reads the second's rows too."""
    pool = Pool.objects.get(name="h100")
    run = TaskRun.objects.create(
        lease_id=uuid.uuid4(), task=task, pool=pool, attempt=1, agent_id="a", dispatched_at=timezone.now()
    )
    Task.objects.filter(pk=task.pk).update(pool=pool, lease_id=run.pk)
    with transaction.atomic(), deferred.writes_deferred():
        task.reason = "carried"
        deferred.update_fields(task, ["reason"])
        found, found_run = pool_task_and_run(str(task.pk), str(run.pk), pool)
    assert found is not None
    assert found_run is not None
    assert (found.reason, found_run.pk) == ("carried", run.pk)


def test_what_is_kept_at_the_end_of_the_block_is_sent_before_the_commit(task: Task) -> None:
    with transaction.atomic():
        with deferred.writes_deferred():
            deferred.insert(event(task, "last"))
        with connection.cursor() as cursor:  # the block is over: no wrapper carries anything now
            cursor.execute("SELECT message FROM scheduling_taskevent WHERE actor = %s", ["test"])
            assert cursor.fetchall() == [("last",)]


def test_a_block_left_by_an_error_sends_nothing(task: Task) -> None:
    def failing() -> None:
        with transaction.atomic(), deferred.writes_deferred():
            deferred.insert(event(task, "lost"))
            raise RuntimeError("refused")

    with pytest.raises(RuntimeError):
        failing()
    assert messages(task) == []
    with CaptureQueriesContext(connection) as queries:
        deferred.insert(event(task, "after"))  # no block any more: sent at once
    assert len(queries) == 1


def test_a_savepoint_after_kept_writes_does_not_undo_them(task: Task) -> None:
    with transaction.atomic(), deferred.writes_deferred():
        deferred.insert(event(task, "before"))
        with contextlib.suppress(RuntimeError), transaction.atomic():
            deferred.insert(event(task, "inside"))
            raise RuntimeError("undo the savepoint")
        deferred.insert(event(task, "after"))
    assert messages(task) == ["before", "after"]


@pytest.mark.parametrize(
    ("sql", "params"),
    [
        ("SELECT count(*) FROM scheduling_taskevent WHERE actor = %(actor)s", {"actor": "test"}),
        ("SELECT count(*) FROM scheduling_taskevent WHERE actor LIKE 'te%'", None),
    ],
    ids=["named-placeholders", "percent-without-parameters"],
)
def test_a_statement_with_other_placeholders_goes_after_the_writes_sent_alone(
    task: Task, sql: str, params: dict[str, str] | None
) -> None:
    with transaction.atomic(), deferred.writes_deferred():
        deferred.insert(event(task, "one"))
        with CaptureQueriesContext(connection) as queries, connection.cursor() as cursor:
            cursor.execute(sql, params)
            assert cursor.fetchone() == (1,)
        assert len(queries) == 2


def test_an_executemany_goes_after_the_writes_sent_alone(task: Task) -> None:
    with transaction.atomic(), deferred.writes_deferred():
        deferred.insert(event(task, "one"))
        with connection.cursor() as cursor:
            cursor.executemany(
                "UPDATE scheduling_taskevent SET message = message || %s WHERE actor = %s",
                [["!", "test"]] * 2,
            )
        assert messages(task) == ["one!!"]


def test_a_kept_write_that_fails_fails_the_statement_that_carries_it_and_the_transaction(task: Task) -> None:
    too_long = event(task, "refused")
    too_long.actor = "x" * 201  # the column holds 200

    def failing() -> None:
        with transaction.atomic(), deferred.writes_deferred():
            deferred.insert(event(task, "undone with it"))
            deferred.insert(too_long)
            Task.objects.get(pk=task.pk)

    with pytest.raises(DatabaseError, match="too long"):
        failing()
    assert messages(task) == []


def test_an_insert_writes_the_instances_defaults_and_an_update_its_foreign_keys(task: Task) -> None:
    pool = Pool.objects.get(name="h100")
    now = timezone.now()
    run = TaskRun(lease_id=uuid.uuid4(), task=task, pool=pool, attempt=4, agent_id="a-1", dispatched_at=now)
    started = now - timedelta(minutes=1)
    with transaction.atomic(), deferred.writes_deferred():
        deferred.insert(run)
        task.pool, task.started_at = pool, started
        deferred.update_fields(task, ["pool", "started_at"])
    kept = TaskRun.objects.get(pk=run.pk)
    assert (kept.task_id, kept.pool_id, kept.attempt, kept.agent_id) == (task.pk, pool.pk, 4, "a-1")
    assert (kept.outcome, kept.size_units, kept.note, kept.stop_grace_seconds) == (
        RunOutcome.LIVE,
        0,
        "",
        0.0,
    )
    assert Task.objects.filter(pk=task.pk, pool=pool, started_at=started).exists()


def test_a_block_is_opened_only_in_a_transaction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        connections["default"], "in_atomic_block", False
    )  # as outside the test's own transaction
    with pytest.raises(RuntimeError, match="within a transaction"), deferred.writes_deferred():
        pass


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("in_block", [False, True], ids=["alone", "in-a-block"])
def test_many_rows_go_in_one_insert_and_one_message_of_updates(
    task: Task, count: int, in_block: bool
) -> None:
    """insert_many and update_many: one statement (one message) each outside a block, nothing of their own
    within one; the rows as bulk_create and update_fields would write them."""
    pool = Pool.objects.get(name="h100")
    now = timezone.now()
    runs = [
        TaskRun(lease_id=uuid.uuid4(), task=task, pool=pool, attempt=n, agent_id=f"a-{n}", dispatched_at=now)
        for n in range(1, count + 1)
    ]
    tasks = [Task.objects.get(pk=task.pk) for _ in range(count)]  # the same row: the last update wins
    for n, each in enumerate(tasks):
        each.reason, each.priority = f"update {n}", n
    block = deferred.writes_deferred() if in_block else contextlib.nullcontext()
    with transaction.atomic(), block:
        with CaptureQueriesContext(connection) as queries:
            deferred.insert_many([*runs, *[]])
            deferred.insert_many([event(task, f"event {n}") for n in range(count)])
            deferred.update_many(tasks, ["reason", "priority"])
            deferred.insert_many([])
            deferred.update_many([], ["reason"])
        assert len(queries) == (0 if in_block else 3)
        if not in_block:
            assert queries[0]["sql"].count("), (") == count - 1  # rows of one INSERT
            assert queries[2]["sql"].count("; ") == count - 1  # updates of one message
    kept = TaskRun.objects.filter(task=task).order_by("attempt")
    assert [(run.attempt, run.agent_id, run.outcome) for run in kept] == [
        (n, f"a-{n}", RunOutcome.LIVE) for n in range(1, count + 1)
    ]
    assert all(not run._state.adding for run in runs)
    assert messages(task) == [f"event {n}" for n in range(count)]
    assert Task.objects.filter(pk=task.pk, reason=f"update {count - 1}", priority=count - 1).exists()
