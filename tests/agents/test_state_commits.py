"""The agent's state commits what a turn of its loop records at once, and sends nothing before: changes
alone and grouped, a change undone whole, the runs kept in memory as the file holds them, a full or busy
disk, and the agent's order of commit and send."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from agents.baremetal import BareMetal
from agents.main import Agent
from agents.state import LogCursor, RunRecord, State, StateLost


def run_record(task_id: str, offset: int = 0) -> RunRecord:
    folder = f"/w/{task_id}"
    return RunRecord(task_id, 4242, f"{folder}/output.log", f"{folder}/exit-code", offset, [0], 100, [])


def on_disk(path: Path, sql: str, parameters: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """What another connection (a restarted agent) reads from the file: only what was committed."""
    reader = sqlite3.connect(path)
    try:
        return reader.execute(sql, parameters).fetchall()
    finally:
        reader.close()


class Grouped:
    """A State in group mode, counting the transactions it opened."""

    def __init__(self, path: Path) -> None:
        self.state, self.opened = State(path), 0
        self.state.group_commits(self.open)

    def open(self) -> None:
        self.opened += 1


def test_alone_each_change_is_on_disk_when_it_returns(tmp_path: Path) -> None:
    path = tmp_path / "agent.sqlite"
    state = State(path)
    state.lease_begin("t", "lease-1", 1)
    state.add_run(run_record("t"))
    state.enqueue("t", "log", {"lines": ["a"]}, offset=2)
    assert on_disk(path, "SELECT task_id, lease_id FROM leases") == [("t", "lease-1")]
    assert on_disk(path, 'SELECT task_id, "offset" FROM runs') == [("t", 2)]
    assert on_disk(path, "SELECT seq FROM reports") == [(1,)]
    assert not state.uncommitted


def test_grouped_changes_are_one_transaction_on_disk_only_at_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "agent.sqlite"
    grouped = Grouped(path)
    state = grouped.state
    state.lease_begin("t", "lease-1", 1)
    state.add_run(run_record("t"))
    state.enqueue("t", "status", {"state": "running"})
    state.enqueue("t", "log", {"lines": ["a"]}, offset=2)
    state.lease_begin("u", "lease-2", 1)
    state.acknowledge("t", "lease-1", 1)
    assert grouped.opened == 1
    assert state.uncommitted
    # This connection reads what it changed; the file holds none of it yet.
    assert [m["seq"] for m in state.pending()] == [2]
    assert state.offset("t") == 2
    assert on_disk(path, "SELECT * FROM reports") == []
    assert on_disk(path, "SELECT * FROM leases") == []
    state.commit()
    assert not state.uncommitted
    assert on_disk(path, "SELECT task_id, lease_id, seq FROM reports") == [("t", "lease-1", 2)]
    assert on_disk(path, 'SELECT task_id, "offset" FROM runs') == [("t", 2)]
    assert sorted(on_disk(path, "SELECT task_id FROM leases")) == [("t",), ("u",)]
    # The next change opens the next transaction.
    state.remove_run("t")
    assert grouped.opened == 2
    state.commit()
    assert on_disk(path, "SELECT * FROM runs") == []
    state.commit()  # none open: nothing to do


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "grouped"])
@pytest.mark.parametrize(
    "body",
    [{"lines": [object()]}, {"value": {1, 2}}, {"bytes": b"\x00"}],
    ids=["an object", "a set", "bytes"],
)
def test_a_change_that_fails_midway_is_undone_whole_and_the_rest_kept(
    tmp_path: Path, grouped: bool, body: dict[str, Any]
) -> None:
    """A report that cannot be written leaves no number taken, no offset moved, and (grouped) takes
    nothing else of the open transaction with it."""
    path = tmp_path / "agent.sqlite"
    state = Grouped(path).state if grouped else State(path)
    state.lease_begin("t", "lease-1", 1)
    state.add_run(run_record("t"))
    state.enqueue("t", "log", {"lines": ["a"]}, offset=5)
    with pytest.raises(TypeError):
        state.enqueue("t", "log", body, offset=9)
    assert state.offset("t") == 5
    assert state.enqueue("t", "log", {"lines": ["b"]}, offset=7)["seq"] == 2
    state.commit()
    assert on_disk(path, "SELECT seq FROM reports ORDER BY seq") == [(1,), (2,)]
    assert on_disk(path, 'SELECT "offset" FROM runs') == [(7,)]
    assert on_disk(path, "SELECT last FROM run_sequences") == [(2,)]


def test_the_runs_kept_in_memory_are_the_files(tmp_path: Path) -> None:
    path = tmp_path / "agent.sqlite"
    state = Grouped(path).state
    state.lease_begin("a", "la", 1)
    state.add_run(run_record("a"))
    state.add_run(run_record("b"))
    state.add_run(run_record("c"))
    state.remove_run("b")
    state.add_run(run_record("a", offset=3))  # added again: last, as in the table
    state.enqueue("c", "log", {"lines": ["x"]}, offset=11)
    state.enqueue("c", "log", {"lines": ["y"]}, offset=LogCursor("pod", "2026-01-01T00:00:00Z", 1))
    state.commit()
    again = State(path)
    assert state.runs() == again.runs()
    assert [run.task_id for run in state.runs()] == ["c", "a"]
    assert state.run("c") == again.run("c") == run_record("c", offset=11)
    assert state.run("b") is None
    assert state.offset("a") == again.offset("a") == 3


def test_a_rollback_gives_back_what_the_file_holds(tmp_path: Path) -> None:
    path = tmp_path / "agent.sqlite"
    state = Grouped(path).state
    state.add_run(run_record("a"))
    state.commit()
    state.add_run(run_record("b"))
    state.enqueue("a", "log", {"lines": ["x"]}, offset=8)
    state.rollback()
    assert [run.task_id for run in state.runs()] == ["a"]
    assert state.offset("a") == 0
    assert state.pending() == []


def fill(state: State) -> None:
    """Let the database file grow no more: SQLite answers the next page it needs with SQLITE_FULL."""
    pages = state.db.execute("PRAGMA page_count").fetchone()[0]
    state.db.execute(f"PRAGMA max_page_count = {pages}")


def make_changes(state: State, change: str) -> None:
    """Changes of a kind, enough to need a page more."""
    for index in range(200):
        if change == "report":
            state.enqueue("a", "log", {"lines": ["x" * 2000]}, offset=5 + index)
        elif change == "run":
            state.add_run(RunRecord(f"r{index}", 1, "x" * 2000, "e", 0, [0], 100, []))
        else:
            state.lease_begin(f"r{index}" + "x" * 2000, "l", 1)


@pytest.mark.parametrize("change", ["report", "run", "lease"])
def test_a_full_disk_loses_the_group_and_the_commit_says_so(tmp_path: Path, change: str) -> None:
    """SQLite rolls a transaction back when the disk is full: the commit after raises StateLost (never
    carries on as if the earlier changes were kept), and the State holds what the file does."""
    path = tmp_path / "agent.sqlite"
    state = Grouped(path).state
    state.add_run(run_record("a"))
    state.lease_begin("a", "la", 1)
    state.commit()
    state.enqueue("a", "log", {"lines": ["kept in memory only"]}, offset=4)
    fill(state)
    with pytest.raises(sqlite3.OperationalError, match="full"):
        make_changes(state, change)
    with pytest.raises(StateLost, match="could not be written"):
        state.commit()
    assert state.offset("a") == 0
    assert [run.task_id for run in state.runs()] == ["a"]
    assert state.pending() == []
    assert on_disk(path, "SELECT * FROM reports") == []
    state.db.execute("PRAGMA max_page_count = 1073741823")
    state.enqueue("a", "log", {"lines": ["after"]}, offset=4)  # numbering goes on from the file's
    state.commit()
    assert on_disk(path, "SELECT seq FROM reports") == [(1,)]


class FlakyCommits:
    """The State's connection, whose COMMIT fails while `failing` says so: busy (the transaction stays
    open) or lost (SQLite rolled it back, as a full disk does)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.failing = db, ""

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT" and self.failing == "busy":
            raise sqlite3.OperationalError("database is locked")
        if sql == "COMMIT" and self.failing == "lost":
            self.db.execute("ROLLBACK")
            raise sqlite3.OperationalError("disk I/O error")
        return self.db.execute(sql, *args)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction


class Socket:
    """A connection that records each message it sends, and whether the file held its report then."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sent: list[dict[str, Any]] = []
        self.committed_when_sent: list[bool] = []

    async def send(self, text: str) -> None:
        message = json.loads(text)
        self.sent.append(message)
        if "seq" in message:
            sql = "SELECT 1 FROM reports WHERE task_id = ? AND seq = ?"
            rows = on_disk(self.path, sql, (message["task_id"], message["seq"]))
            self.committed_when_sent.append(bool(rows))


def connected_agent(tmp_path: Path) -> tuple[Agent, Socket, list[StateLost]]:
    state = State(tmp_path / "agent.sqlite")
    agent = Agent(
        url="http://acme.localhost:8000", token="kqa_x_y", backend=BareMetal(1, tmp_path, state), agent_id="a"
    )
    socket = Socket(state.path)
    agent.socket = socket
    lost: list[StateLost] = []
    agent.on_state_lost = lost.append
    state.group_commits(agent._flush_soon)
    return agent, socket, lost


async def turns(count: int = 5) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def test_a_turns_reports_go_out_in_order_after_one_commit(tmp_path: Path) -> None:
    agent, socket, _ = connected_agent(tmp_path)
    commits: list[bool] = []
    real_commit = agent.state.commit

    def commit() -> None:
        commits.append(agent.state.uncommitted)
        real_commit()

    agent.state.commit = commit  # type: ignore[method-assign]

    async def scenario() -> None:
        agent.state.lease_begin("t", "lease-1", 1)
        for line in ("a", "b", "c"):
            await agent.report("t", "log", {"stream": "stdout", "lines": [line]})
        await agent._send({"type": "accepted", "task_id": "t", "lease_id": "lease-1"})
        assert socket.sent == []  # nothing before the commit
        await turns()
        assert commits.count(True) == 1
        await agent.report("t", "result", {"exit_code": 0})
        await turns()

    asyncio.run(scenario())
    assert [(m["type"], m.get("seq")) for m in socket.sent] == [
        ("log", 1),
        ("log", 2),
        ("log", 3),
        ("accepted", None),
        ("result", 4),
    ]
    assert socket.committed_when_sent == [True, True, True, True]
    assert commits.count(True) == 2


def test_a_busy_disk_holds_the_messages_until_the_commit_goes_through(tmp_path: Path) -> None:
    agent, socket, lost = connected_agent(tmp_path)
    flaky = FlakyCommits(agent.state.db)
    agent.state._db = flaky  # type: ignore[assignment]

    async def scenario() -> None:
        agent.state.lease_begin("t", "lease-1", 1)
        flaky.failing = "busy"
        await agent.report("t", "log", {"stream": "stdout", "lines": ["a"]})
        await asyncio.sleep(0.5)  # a few tries, backed off
        assert socket.sent == []
        assert agent.state.uncommitted
        await agent.report("t", "log", {"stream": "stdout", "lines": ["b"]})  # joins the waiting one
        flaky.failing = ""
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(socket.sent) == 2:
                break

    asyncio.run(scenario())
    assert [m["seq"] for m in socket.sent] == [1, 2]
    assert socket.committed_when_sent == [True, True]
    assert lost == []


def test_a_lost_commit_sends_nothing_and_ends_the_agent(tmp_path: Path) -> None:
    """What a turn recorded was rolled back: none of what it would send goes out (the plane must not
    acknowledge or act on what the agent no longer has), and the agent ends (its restart adopts)."""
    agent, socket, lost = connected_agent(tmp_path)
    flaky = FlakyCommits(agent.state.db)
    agent.state._db = flaky  # type: ignore[assignment]

    async def scenario() -> None:
        agent.state.lease_begin("t", "lease-1", 1)
        await turns()
        flaky.failing = "lost"
        await agent.report("t", "log", {"stream": "stdout", "lines": ["a"]})
        await agent._send({"type": "accepted", "task_id": "t", "lease_id": "lease-1"})
        await turns()

    asyncio.run(scenario())
    assert socket.sent == []
    assert len(lost) == 1
    assert on_disk(tmp_path / "agent.sqlite", "SELECT * FROM reports") == []


def test_a_message_for_a_closed_connection_is_not_sent_on_the_next(tmp_path: Path) -> None:
    """Queued for one connection, which closed before the commit: it does not go out on the next one
    before that one's hello (the outbox replays the reports in their place)."""
    agent, first, _ = connected_agent(tmp_path)
    second = Socket(first.path)

    async def scenario() -> None:
        agent.state.lease_begin("t", "lease-1", 1)
        await agent.report("t", "log", {"stream": "stdout", "lines": ["a"]})
        agent.socket = second  # the first closed; the second is this agent's now
        await turns()

    asyncio.run(scenario())
    assert first.sent == []
    assert second.sent == []
