"""The latest lines of a task's log, read newest first and only as far back as asked: the same lines,
streams, cursor and 'earlier lines omitted' as reading the whole log and cutting it, over logs of many
shapes (one big chunk, many small ones, more chunks than one read takes)."""

from __future__ import annotations

import pytest
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.fleet.models import TaskReport
from apps.fleet.selectors import task_log_tail, task_logs
from apps.scheduling.services import TaskRequest, tasks_submit
from tests.world import World

pytestmark = pytest.mark.django_db

SHAPES = {
    "one chunk": [30],
    "small chunks": [1] * 450,  # more chunks than one read of 200 takes
    "mixed": [5, 1, 0, 40, 2, 7, 1, 1, 120, 3],
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("wanted", [1, 3, 100, 500])
@pytest.mark.parametrize("skip", [0, 2])
def test_the_tail_is_the_end_of_the_whole_log(world: World, shape: str, wanted: int, skip: int) -> None:
    with schema_context("acme"):
        (task,) = tasks_submit(
            tenant=world.tenant_a,
            user=User.objects.get(username="bob"),
            requests=[TaskRequest(compute_resource="Research: 4 GPUs")],
        )
        number = 0
        for seq, size in enumerate(SHAPES[shape]):
            said = [f"line {number + index}" for index in range(size)]
            number += size
            stream = "stderr" if seq % 3 == 2 else "stdout"
            TaskReport.objects.create(task=task, seq=seq, kind="log", body={"stream": stream, "lines": said})
        chunks = task_logs(task)
        after = chunks[skip - 1]["cursor"] if 0 < skip < len(chunks) else 0
        everything = [
            (chunk["stream"], line) for chunk in task_logs(task, after=after) for line in chunk["lines"]
        ]
        lines, cursor, omitted = task_log_tail(task, after=after, lines=wanted)
        assert lines == everything[-wanted:]
        assert cursor == chunks[-1]["cursor"]
        assert omitted == (len(everything) > wanted)
        assert task_log_tail(task, after=cursor, lines=wanted) == ([], cursor, False)
