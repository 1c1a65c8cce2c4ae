"""A burst of an agent's messages reads the tasks and runs it names in one round trip as it opens
(selectors.burst_read): each task's first lookup takes its row from there, a later one the instances its
message before handed back as current (selectors.burst_current), or the database. Compared with the
lookups one by one on every kind of id an agent may send, and in a whole burst. In the same round trip, which
of the burst's reports the runs have kept (selectors.burst_report_new), so that a new one is inserted with
the statement after it and a replay is answered without a write."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django_tenants.utils import schema_context

from apps.fleet import dispatch
from apps.fleet.models import TaskReport
from apps.fleet.selectors import burst_current, burst_read, burst_report_new, pool_task_and_run
from apps.resources.models import Pool
from apps.scheduling.models import Task, TaskState
from tests.fleet.test_bursts import (
    answers,
    assigned,
    segments_of,
    sent_while_busy,
    statements_of_bursts,
    states,
)
from tests.fleet.test_fencing import run_of, second_task


def pair(found: tuple[Any, Any]) -> tuple[Any, Any]:
    task, run = found
    return (task and task.pk, run and run.pk)


def test_every_kind_of_id_finds_in_a_burst_what_it_finds_alone(fleet: dict[str, Any]) -> None:
    second = second_task(fleet)
    with schema_context("fleet"):
        h100, baremetal = Pool.objects.get(name="h100"), Pool.objects.get(name="baremetal")
        [one, two] = dispatch.dispatch(pool=h100, schema_name="fleet", agent_id="rack-1")
        Task.objects.filter(pk=two["task_id"]).update(pool=None, state="queued")  # its run stays in h100
        cases = [
            (one["task_id"], one["lease_id"]),  # its own run
            (two["task_id"], two["lease_id"]),  # queued again, its run here
            (one["task_id"], two["lease_id"]),  # another task's lease
            (one["task_id"], str(uuid.uuid4())),  # unknown lease
            (one["task_id"], "not-a-lease"),
            (one["task_id"], ""),
            (str(uuid.uuid4()), one["lease_id"]),  # unknown task
            ("1 OR 1=1", one["lease_id"]),
            ("x'; DROP TABLE scheduling_task; --", one["lease_id"]),
        ]
        for pool in (h100, baremetal):
            for case in cases:
                with transaction.atomic():
                    alone = pair(pool_task_and_run(*case, pool))
                with transaction.atomic(), burst_read(cases, pool):
                    # the case looked up after another that names the same task, as in a burst
                    for other in cases:
                        if other != case:
                            pool_task_and_run(*other, pool)
                    later = pair(pool_task_and_run(*case, pool))
                with transaction.atomic(), burst_read(cases, pool):
                    first = pair(pool_task_and_run(*case, pool))
                assert first == later == alone, (pool.name, case)
    connections.close_all()
    assert second


def test_a_burst_reads_its_tasks_in_one_statement_and_hands_current_ones_on(fleet: dict[str, Any]) -> None:
    second_task(fleet)
    with schema_context("fleet"):
        h100 = Pool.objects.get(name="h100")
        [one, two] = dispatch.dispatch(pool=h100, schema_name="fleet", agent_id="rack-1")
        named = [(one["task_id"], one["lease_id"]), (two["task_id"], two["lease_id"])] * 2
        with CaptureQueriesContext(connection) as queries, transaction.atomic(), burst_read(named, h100):
            task, run = pool_task_and_run(one["task_id"], one["lease_id"], h100)
            assert task is not None
            assert run is not None
            task.reason = "changed in place, as a message changes it"
            burst_current(task, run, h100)
            again, again_run = pool_task_and_run(one["task_id"], one["lease_id"], h100)
            pool_task_and_run(two["task_id"], two["lease_id"], h100)
            reread, _ = pool_task_and_run(two["task_id"], two["lease_id"], h100)  # not handed back: read
    connections.close_all()
    assert (again, again_run) == (task, run)
    assert again is task
    assert reread is not None
    reads = [q["sql"] for q in queries.captured_queries if "FOR UPDATE OF t" in q["sql"]]
    assert len(reads) == 2  # the block's, and the re-read of the task not handed back
    assert "ANY(" in reads[0]


def test_a_task_queued_again_is_not_handed_on(fleet: dict[str, Any]) -> None:
    with schema_context("fleet"):
        h100 = Pool.objects.get(name="h100")
        [one] = dispatch.dispatch(pool=h100, schema_name="fleet", agent_id="rack-1")
        named = [(one["task_id"], one["lease_id"])]
        with CaptureQueriesContext(connection) as queries, transaction.atomic(), burst_read(named, h100):
            task, run = pool_task_and_run(one["task_id"], one["lease_id"], h100)
            assert task is not None
            assert run is not None
            task.pool = None  # as a run given back to the queue leaves it
            burst_current(task, run, h100)
            pool_task_and_run(one["task_id"], one["lease_id"], h100)
    connections.close_all()
    assert len([q for q in queries.captured_queries if "FOR UPDATE OF t" in q["sql"]]) == 2


@pytest.mark.parametrize("exit_codes", [(0, 0), (0, 3)], ids=["both-completed", "one-retried"])
def test_a_whole_burst_reads_its_tasks_once_and_ends_as_message_by_message(
    fleet: dict[str, Any], exit_codes: tuple[int, int]
) -> None:
    second = second_task(fleet)
    sent, capturing = statements_of_bursts()

    async def scenario() -> tuple[list[dict[str, Any]], str, str]:
        client, (one, two) = await assigned(fleet, 2)
        await sent_while_busy(
            client,
            [
                {"type": "accepted", **run_of(one)},
                {"type": "accepted", **run_of(two)},
                {"type": "status", **run_of(one), "seq": 1, "state": "running"},
                {"type": "log", **run_of(one), "seq": 2, "lines": ["hello"]},
                {"type": "status", **run_of(two), "seq": 1, "state": "running"},
                {"type": "status", **run_of(one), "seq": 1, "state": "running"},  # a replay: a duplicate
                {"type": "result", **run_of(one), "seq": 3, "exit_code": exit_codes[0]},
                {"type": "result", **run_of(two), "seq": 2, "exit_code": exit_codes[1]},
            ],
        )
        said = await answers(client, 6)
        await client.disconnect()
        return said, one["task_id"], two["task_id"]

    with capturing:
        said, one, two = asyncio.run(scenario())
    assert {one, two} == {fleet["task"], second}
    assert [m["verdict"] for m in said] == [
        "applied",
        "applied",
        "applied",
        "duplicate",
        "applied",
        "applied",
    ]
    retried = exit_codes[1] != 0
    assert states(one, two) == [
        TaskState.COMPLETED,
        TaskState.QUEUED if retried else TaskState.COMPLETED,
    ]
    assert segments_of(one, two) == [1, 1]
    with schema_context("fleet"):
        attempts = list(
            Task.objects.filter(pk__in=[fleet["task"], second]).values_list("attempts", flat=True)
        )
    connections.close_all()
    assert attempts == [1, 1]
    burst = sent[-1]
    assert len([sql for sql in burst if "FOR UPDATE OF t" in sql]) == 1  # eight messages, one read
    # The burst knew which reports were new: none is inserted to find out.
    assert not [sql for sql in burst if "ON CONFLICT ON CONSTRAINT one_report_per_run_source_seq" in sql]
    with schema_context("fleet"):
        kept = list(TaskReport.objects.filter(source="agent").order_by("id").values_list("task_id", "seq"))
    connections.close_all()
    # In the order they came, with one of each: the replay kept nothing.
    assert [(str(task), seq) for task, seq in kept] == [(one, 1), (one, 2), (two, 1), (one, 3), (two, 2)]


def test_a_burst_tells_the_reports_its_tasks_kept_from_new_ones(fleet: dict[str, Any]) -> None:
    second_task(fleet)
    with schema_context("fleet"):
        h100, baremetal = Pool.objects.get(name="h100"), Pool.objects.get(name="baremetal")
        [one, two] = dispatch.dispatch(pool=h100, schema_name="fleet", agent_id="rack-1")
        task = Task.objects.get(pk=one["task_id"])
        for source, seq in (("agent", 1), ("node-0", 2)):  # a node's number is not the agent's
            TaskReport(task=task, lease_id=task.lease_id, source=source, seq=seq, kind="log").insert_once()
        before = TaskReport.objects.order_by("-id").values_list("id", flat=True).first()
        first, second = uuid.UUID(one["task_id"]), uuid.UUID(two["task_id"])
        lease_1, lease_2 = uuid.UUID(one["lease_id"]), uuid.UUID(two["lease_id"])
        named = [(one["task_id"], one["lease_id"]), (two["task_id"], two["lease_id"])]
        reports = [
            (one["task_id"], one["lease_id"], 1),
            (one["task_id"], one["lease_id"], 2),
            (one["task_id"], one["lease_id"], 2),  # twice in one burst
            (two["task_id"], two["lease_id"], 1),
            (one["task_id"], two["lease_id"], 4),  # another task's lease: asked, found nowhere
            (one["task_id"], "not-a-lease", 3),
            ("x'; DROP TABLE fleet_taskreport; --", one["lease_id"], 1),
        ]
        with transaction.atomic(), burst_read(named, h100, reports):
            assert burst_report_new(first, lease_1, 1) == 0  # kept already
            new = burst_report_new(first, lease_1, 2)
            assert new is not None
            assert new > (before or 0)
            assert burst_report_new(first, lease_1, 2) == 0  # kept now, by this burst
            later = burst_report_new(second, lease_2, 1)
            assert later is not None
            assert later > new
            assert burst_report_new(first, lease_1, 9) is None  # not one it was told of: ask the database
            assert burst_report_new(first, None, 3) is None
            kept = TaskReport(task=task, lease_id=task.lease_id, source="agent", seq=2, kind="log")
            kept.insert_new(new)
            assert burst_report_new(first, lease_2, 4) not in (None, 0)  # the insert would tell
            # The insert is kept, with the id taken, and the run's constraint agrees it is there.
            again = TaskReport(task=task, lease_id=task.lease_id, source="agent", seq=2, kind="log")
            assert not again.insert_once()
            assert TaskReport.objects.get(task=task, source="agent", seq=2).pk == new
        with transaction.atomic(), burst_read(named, baremetal, reports):  # another pool's: reads neither
            assert burst_report_new(first, lease_1, 2) is None
        with transaction.atomic(), burst_read(named, h100):  # told of no reports
            assert burst_report_new(first, lease_1, 2) is None
        assert burst_report_new(first, lease_1, 2) is None  # outside a burst
    connections.close_all()
