"""The bare-metal runs' records (agents.records): slots written before a fork, the zygote's pid noted
after the record, read back by a restarted agent, emptied and reused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agents.records import Records
from agents.state import RunRecord
from agents.zygote import _note


def run(task_id: str, devices: list[int]) -> RunRecord:
    return RunRecord(
        task_id, 0, f"/w/{task_id}/output.log", f"/w/{task_id}/exit-code", 0, devices, 100, ["*.pt"]
    )


def test_slots_are_made_once_then_emptied_and_reused(tmp_path: Path) -> None:
    records = Records(tmp_path / "runs")
    first, second = records.write(run("a", [0]), "la", 1), records.write(run("b", [1]), "lb", 2)
    assert (first.name, second.name) == ("0", "1")
    records.clear("a")
    assert first.read_bytes() == b""
    assert records.write(run("c", [0]), "lc", 1) == first  # the emptied slot, not a new file
    records.clear("unknown")  # a run without a record (an agent from before records): nothing to do
    assert sorted(slot.name for slot in (tmp_path / "runs").iterdir()) == ["0", "1"]


def test_a_restarted_agent_reads_each_record_with_the_pid_noted_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agents.records.FORK_SECONDS", 0.2)
    before = Records(tmp_path / "runs")
    forked = before.write(run("a", [0, 1]), "la", 3)
    _note(str(forked), 4242)  # as the zygote does after its fork
    before.write(run("b", [2]), "lb", 1)  # the agent was killed before it asked for the fork
    (tmp_path / "runs" / "notes").write_text("not a slot")

    after = Records(tmp_path / "runs")
    found = {record.run.task_id: record for record in after.read()}
    assert found["a"].run == RunRecord(
        "a", 4242, "/w/a/output.log", "/w/a/exit-code", 0, [0, 1], 100, ["*.pt"]
    )
    assert (found["a"].lease_id, found["a"].attempt, found["a"].forked) == ("la", 3, True)
    assert (found["b"].run.pid, found["b"].forked) == (0, False)
    assert after.held == {"a": forked, "b": tmp_path / "runs" / "1"}
    assert after.write(run("c", [3]), "lc", 1).name == "2"  # numbering goes on after the slots found


@pytest.mark.parametrize(
    "content", [b"", b'{"task_id": "a", "pid": 0', b"\x00\xff\n", b'{"task_id": "a"}\n123\n', b"[1, 2]\n"]
)
def test_a_record_cut_short_or_unreadable_frees_its_slot(tmp_path: Path, content: bytes) -> None:
    """An empty slot, a line cut short by a kill (so no fork came after it), or one no agent wrote."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "0").write_bytes(content)
    records = Records(tmp_path / "runs")
    assert records.read() == []
    assert (records.free, records.held, (tmp_path / "runs" / "0").read_bytes()) == (
        [tmp_path / "runs" / "0"],
        {},
        b"",
    )


def test_a_record_that_cannot_be_written_holds_nothing(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    records = Records(tmp_path / "runs")
    os.mkdir(tmp_path / "runs" / "0")  # in the slot's way
    with pytest.raises(IsADirectoryError):
        records.write(run("a", [0]), "la", 1)
    assert (records.held, records.free) == ({}, [])  # nor is the slot taken again
