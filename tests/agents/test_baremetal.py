"""The bare-metal backend and the agent's state: GPU choice, runs that outlive their agent, output read
once, exit codes, stopping, and the outbox."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agents.baremetal import MAX_LINE, BareMetal, Refused, Starter, split_lines
from agents.main import Agent, Backoff, websocket_address
from agents.records import FOLDER
from agents.state import Position, State
from protocol import messages
from protocol.units import UNITS_PER_GPU

Reports = list[tuple[str, dict[str, Any]]]


def assignment(task_id: str, units: int, command: list[str] | None) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "lease_id": "l",
        "size_units": units,
        "spec": {"command": command} if command else {},
    }


def backend(tmp_path: Path, gpus: int = 4) -> BareMetal:
    return BareMetal(gpus, tmp_path / "work", State(tmp_path / "work" / "agent.sqlite"))


class Recorder:
    """Collects reports as the agent would (through the state, so offsets move), until a result."""

    def __init__(self, state: State) -> None:
        self.state, self.finished = state, asyncio.Event()
        self.reports: Reports = []

    async def __call__(self, task_id: str, kind: str, body: dict[str, Any], offset: Position | None) -> None:
        self.state.enqueue(task_id, kind, body, offset=offset)
        self.reports.append((kind, body))
        if kind == "result":
            self.finished.set()

    def lines(self) -> list[str]:
        return [line for kind, body in self.reports if kind == "log" for line in body["lines"]]


def test_a_task_runs_on_its_gpus_and_reports_output_and_exit(tmp_path: Path) -> None:
    bare = backend(tmp_path)
    script = "import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES']); print('done'); sys.exit(3)"

    async def scenario() -> Recorder:
        recorder = Recorder(bare.state)
        await bare.start(assignment("t1", 2 * UNITS_PER_GPU, [sys.executable, "-c", script]), recorder)
        await asyncio.wait_for(recorder.finished.wait(), timeout=30)
        return recorder

    recorder = asyncio.run(scenario())
    assert recorder.reports[0] == ("status", {"state": "running", "devices": [0, 1]})
    assert recorder.lines() == ["0,1", "done"]
    assert recorder.reports[-1] == (
        "result",
        {"exit_code": 3, "stopped": False, "outputs": [], "outputs_failed": []},
    )
    assert bare.used == {0: 0, 1: 0}  # the devices are free again
    assert bare.running() == []


def test_a_run_outlives_its_agent_and_the_next_agent_reads_on(tmp_path: Path) -> None:
    """The first agent reads part of the output and vanishes; the next one, on the same state, takes the
    run back, reads only what the first had not, and reports the end: every line exactly once."""
    script = "import time\nfor i in range(6):\n    print(f'line {i}', flush=True)\n    time.sleep(0.3)\n"

    async def first_agent() -> list[str]:
        bare = backend(tmp_path)
        recorder = Recorder(bare.state)
        await bare.start(assignment("t", UNITS_PER_GPU, [sys.executable, "-c", script]), recorder)
        deadline = asyncio.get_running_loop().time() + 20
        while not recorder.lines() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for follower in list(bare.followers):
            follower.cancel()  # the agent dies here; its runner goes on
        return recorder.lines()

    async def next_agent() -> Recorder:
        bare = backend(tmp_path)
        recorder = Recorder(bare.state)
        assert bare.adopt(recorder) == ["t"]
        await asyncio.wait_for(recorder.finished.wait(), timeout=30)
        return recorder

    before = asyncio.run(first_agent())
    after = asyncio.run(next_agent())
    assert 0 < len(before) < 6
    assert before + after.lines() == [f"line {i}" for i in range(6)]
    assert "status" not in [kind for kind, _ in after.reports]  # its start was reported, and committed
    assert after.reports[-1] == (
        "result",
        {"exit_code": 0, "stopped": False, "outputs": [], "outputs_failed": []},
    )


def test_shares_go_on_one_device_and_whole_gpus_need_free_ones(tmp_path: Path) -> None:
    bare = backend(tmp_path, gpus=2)
    assert bare._pick(UNITS_PER_GPU // 2) == [0]
    bare.used = {0: UNITS_PER_GPU // 2}
    assert bare._pick(UNITS_PER_GPU // 4) == [0]  # the fullest device that still fits
    assert bare._pick(UNITS_PER_GPU) == [1]
    with pytest.raises(Refused, match="2 free GPUs are needed and this host has 1"):
        bare._pick(2 * UNITS_PER_GPU)


def test_a_task_without_a_command_is_refused(tmp_path: Path) -> None:
    bare = backend(tmp_path)
    with pytest.raises(Refused, match="no command"):
        asyncio.run(bare.start(assignment("t", UNITS_PER_GPU, None), Recorder(bare.state)))


def test_stop_sends_sigterm_then_sigkill_after_the_grace_period(tmp_path: Path) -> None:
    stubborn = "; ".join(
        [
            "import signal, time",
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)",
            "print('up', flush=True)",
            "time.sleep(60)",
        ]
    )
    bare = backend(tmp_path)

    async def scenario() -> tuple[Recorder, float]:
        recorder = Recorder(bare.state)
        await bare.start(assignment("t", UNITS_PER_GPU, [sys.executable, "-c", stubborn]), recorder)
        while not recorder.lines():
            await asyncio.sleep(0.05)
        started = asyncio.get_running_loop().time()
        await bare.stop("t", grace_seconds=0.5)
        await asyncio.wait_for(recorder.finished.wait(), timeout=30)
        return recorder, asyncio.get_running_loop().time() - started

    recorder, took = asyncio.run(scenario())
    assert recorder.reports[-1] == (
        "result",
        {"exit_code": -9, "stopped": True, "outputs": [], "outputs_failed": []},
    )  # it ignored SIGTERM
    assert 0.5 <= took < 10


def test_a_polite_task_stops_on_sigterm(tmp_path: Path) -> None:
    bare = backend(tmp_path)

    async def scenario() -> Recorder:
        recorder = Recorder(bare.state)
        await bare.start(
            assignment(
                "t",
                UNITS_PER_GPU,
                [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
            ),
            recorder,
        )
        while not recorder.lines():
            await asyncio.sleep(0.05)
        await bare.stop("t", grace_seconds=10)
        await asyncio.wait_for(recorder.finished.wait(), timeout=30)
        return recorder

    assert asyncio.run(scenario()).reports[-1] == (
        "result",
        {"exit_code": -15, "stopped": True, "outputs": [], "outputs_failed": []},
    )


def test_huge_lines_are_cut_into_pieces_not_dropped() -> None:
    pieces = split_lines("x" * (2 * MAX_LINE + 10) + "\nshort")
    assert [len(piece) for piece in pieces] == [MAX_LINE, MAX_LINE, 10, 5]


def test_reports_stay_in_the_outbox_until_acknowledged(tmp_path: Path) -> None:
    bare = backend(tmp_path)
    agent = Agent(url="http://acme.localhost:8000", token="kqa_x_y", backend=bare, agent_id="a")

    async def scenario() -> None:
        bare.state.lease_begin("t", "lease-1", 1)
        await agent.report("t", "status", {"state": "running"})
        await agent.report("t", "log", {"stream": "stdout", "lines": ["hello"]})
        await agent.report("t", "log", {"stream": "stdout", "lines": ["again"]})
        await agent._on_message(messages.Ack("t", "lease-1", 1, messages.APPLIED))
        await agent._on_message(messages.Ack("t", "lease-1", 3, messages.STALE, "another attempt runs"))
        await agent._on_message(messages.Ack("t", "lease-0", 2, messages.APPLIED))  # another run's number

    asyncio.run(scenario())
    # Kept on disk: a restarted agent replays it, naming its run.
    pending = State(tmp_path / "work" / "agent.sqlite").pending()
    assert [(m["task_id"], m["lease_id"], m["seq"]) for m in pending] == [("t", "lease-1", 2)]
    assert agent.held() == (messages.Held("t", "lease-1", ended=True),)


def test_a_new_run_of_a_task_numbers_its_reports_afresh_and_an_old_outbox_is_answered(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "agent.sqlite"
    old = sqlite3.connect(path)  # an agent's state from before leases
    old.executescript(
        """CREATE TABLE outbox (task_id TEXT, seq INTEGER, message TEXT, PRIMARY KEY (task_id, seq));
        CREATE TABLE sequences (task_id TEXT PRIMARY KEY, last INTEGER);
        INSERT INTO outbox VALUES ('t', 7, '{"type": "log", "task_id": "t", "seq": 7, "lines": []}');"""
    )
    old.commit()
    old.close()
    state = State(path)
    assert state.pending_runs() == {("t", "")}  # kept, to be answered stale and dropped
    state.lease_begin("t", "first", 1)
    assert state.enqueue("t", "log", {"lines": ["a"]})["seq"] == 1
    assert state.enqueue("t", "log", {"lines": ["b"]})["seq"] == 2
    state.acknowledge("t", "first", 1)
    state.acknowledge("t", "first", 2)
    state.lease_begin("t", "second", 2)
    message = state.enqueue("t", "log", {"lines": ["c"]})
    assert (message["lease_id"], message["seq"]) == ("second", 1)
    state.acknowledge("t", "", 7)
    assert [m["lease_id"] for m in state.pending()] == ["second"]


def test_addresses_and_backoff() -> None:
    assert websocket_address("http://demo.localhost:8000") == (
        "ws://demo.localhost:8000/agents/ws/",
        {},
        {"host": "127.0.0.1", "port": 8000},
    )
    assert websocket_address("https://acme.klique.example")[0] == "wss://acme.klique.example/agents/ws/"
    backoff = Backoff(base=1, cap=8)
    assert all(0 <= backoff.next() <= 8 for _ in range(6))
    backoff.reset()
    assert backoff.failures == 0


def test_declared_outputs_are_uploaded_before_the_result(tmp_path: Path) -> None:
    bare = backend(tmp_path)
    uploaded: dict[str, bytes] = {}

    async def upload(task_id: str, name: str, path: Path) -> None:
        uploaded[name] = path.read_bytes()

    bare.upload = upload
    script = "import pathlib; pathlib.Path('out').mkdir(); pathlib.Path('out/metrics.json').write_text('{}')"

    async def scenario() -> Recorder:
        recorder = Recorder(bare.state)
        task = assignment("t", UNITS_PER_GPU, [sys.executable, "-c", script])
        task["spec"]["outputs"] = ["out/*.json", "../../etc/passwd", "missing.txt"]
        await bare.start(task, recorder)
        await asyncio.wait_for(recorder.finished.wait(), timeout=30)
        return recorder

    recorder = asyncio.run(scenario())
    assert uploaded == {"out/metrics.json": b"{}"}  # nothing outside the task's folder
    assert recorder.reports[-1][1]["outputs"] == ["out/metrics.json"]


class FakeNVML:
    """A stand-in for pynvml on a host with one H100 in MIG mode (two 1g.10gb and one 3g.40gb slice) and one
    whole GPU: no GPU is lent to the test machines, so NVML's answers are played back."""

    NVML_DEVICE_MIG_ENABLE = 1

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMigMode(self, handle: int) -> tuple[int, int]:
        if handle == 1:
            raise self.NVMLError("not supported")
        return 1, 1

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, slot: int) -> tuple[int, int]:
        if slot > 2:
            raise self.NVMLError("no such slot")
        return handle, slot

    def nvmlDeviceGetUUID(self, mig: tuple[int, int]) -> bytes:
        return f"MIG-{mig[0]}-{mig[1]}".encode()

    def nvmlDeviceGetName(self, mig: tuple[int, int]) -> str:
        return "NVIDIA H100 80GB HBM3 MIG " + ("3g.40gb" if mig[1] == 2 else "1g.10gb")


def test_mig_slices_are_found_and_handed_out_by_uuid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agents.baremetal import MigDevice, detect_gpus

    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML())
    gpus, slices = detect_gpus() or (0, [])
    assert gpus == 2
    assert slices == [
        MigDevice("MIG-0-0", "1g.10gb", 0),
        MigDevice("MIG-0-1", "1g.10gb", 0),
        MigDevice("MIG-0-2", "3g.40gb", 0),
    ]
    bare = BareMetal(gpus, tmp_path / "work", State(tmp_path / "work" / "agent.sqlite"), mig=slices)
    assert bare._pick(UNITS_PER_GPU) == [1]  # GPU 0 serves its slices only
    script = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"

    async def scenario() -> list[str]:
        seen = []
        for task_id in ("a", "b"):
            recorder = Recorder(bare.state)
            task = assignment(
                task_id, UNITS_PER_GPU // 7, [sys.executable, "-c", script + "; import time; time.sleep(0.5)"]
            )
            task |= {"sharing": "mig", "mig_profile": "1g.10gb"}
            await bare.start(task, recorder)
            seen.append(recorder)
        lines = []
        for recorder in seen:
            await asyncio.wait_for(recorder.finished.wait(), timeout=30)
            lines += recorder.lines()
        return lines

    assert asyncio.run(scenario()) == ["MIG-0-0", "MIG-0-1"]
    with pytest.raises(Refused, match=r"No free MIG slice 2g\.20gb"):
        bare._pick_mig("2g.20gb")


def test_sigterm_stops_the_agent_and_its_tasks_cleanly(tmp_path: Path) -> None:
    """An agent that cannot reach its plane keeps retrying; SIGTERM ends it at once, with exit code 0."""
    import signal
    import subprocess
    import time

    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agents.main",
            "--url",
            "http://127.0.0.1:9",
            "--gpus",
            "1",
            "--work-dir",
            str(tmp_path / "agent"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KLIQUE_AGENT_TOKEN": "kqa_x_y"},
    )
    time.sleep(2)  # it has failed to connect at least once by now, and is waiting to retry
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=15) == 0
    assert "reconnecting in" in (agent.stderr.read() if agent.stderr else "")


def test_a_task_that_ended_unreported_is_still_held_at_hello(tmp_path: Path) -> None:
    """Cut off while a task ends, the agent holds its result in the outbox; it must name the task as its own
    when it says hello again, or the plane would take it for lost and run it a second time."""
    bare = backend(tmp_path)
    agent = Agent(url="http://acme.localhost:8000", token="kqa_x_y", backend=bare, agent_id="a")

    async def scenario() -> None:
        await agent.report("done-task", "result", {"exit_code": 0})

    asyncio.run(scenario())
    assert bare.running() == []
    assert agent.holding() == ["done-task"]


def test_secrets_reach_the_task_in_its_environment_and_nothing_on_disk(tmp_path: Path) -> None:
    bare = backend(tmp_path)
    script = "import hashlib, os; print(hashlib.sha256(os.environ['HF_TOKEN'].encode()).hexdigest())"
    secret = "hf_very_secret_value"

    async def scenario() -> Recorder:
        recorder = Recorder(bare.state)
        given = {
            **assignment("t1", UNITS_PER_GPU, [sys.executable, "-c", script]),
            "secrets": {"HF_TOKEN": secret},
        }
        await bare.start(given, recorder)
        await asyncio.wait_for(recorder.finished.wait(), timeout=30)
        return recorder

    recorder = asyncio.run(scenario())
    import hashlib

    assert recorder.lines() == [hashlib.sha256(secret.encode()).hexdigest()]
    for path in (tmp_path / "work").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path  # not in the spec, state or outbox


def test_a_retry_on_the_same_agent_starts_with_an_empty_log_and_folder(tmp_path: Path) -> None:
    """The second run of a task reads only its own output, numbers its reports from 1 in its own lease,
    and finds nothing the first run left in the task's folder."""
    bare = backend(tmp_path)
    script = (
        "import os, sys; print('left:', sorted(os.listdir('.'))); open('partial.ckpt', 'w').write('x'); "
        "print('run', sys.argv[1]); sys.exit(int(sys.argv[2]))"
    )

    async def run(lease: str, argument: str, code: int) -> Recorder:
        recorder = Recorder(bare.state)
        bare.state.lease_begin("t", lease, int(argument))
        command = [sys.executable, "-c", script, argument, str(code)]
        await bare.start({**assignment("t", UNITS_PER_GPU, command), "lease_id": lease}, recorder)
        await asyncio.wait_for(recorder.finished.wait(), timeout=30)
        return recorder

    first = asyncio.run(run("lease-1", "1", 3))
    second = asyncio.run(run("lease-2", "2", 0))
    assert first.lines()[1:] == ["run 1"]
    listing, *rest = second.lines()
    assert rest == ["run 2"]  # not the first run's lines again
    assert listing.startswith("left: ")
    assert "partial.ckpt" not in listing, listing
    numbered = [(m["lease_id"], m["seq"]) for m in bare.state.pending()]
    assert numbered[:3] == [("lease-1", 1), ("lease-1", 2), ("lease-1", 3)]
    assert [n for n in numbered if n[0] == "lease-2"][:1] == [("lease-2", 1)]


def test_a_run_without_a_lease_learns_it_from_the_welcome(tmp_path: Path) -> None:
    bare = backend(tmp_path)
    agent = Agent(url="http://acme.localhost:8000", token="kqa_x_y", backend=bare, agent_id="a")
    welcome = messages.Welcome(2.0, 30.0, keep=(messages.Held("t", "lease-9"), messages.Held("u", "lease-3")))
    bare.state.lease_begin("u", "lease-2", 2)  # a lease it knows is its own, whatever the welcome says
    asyncio.run(agent._on_message(welcome))
    assert (bare.state.lease("t"), bare.state.lease("u"), agent.heartbeat_seconds) == (
        "lease-9",
        "lease-2",
        2.0,
    )


class KilledWhileStarting:
    """The zygote's starter with the agent killed during a start, before it committed the run: `when`
    "before" the fork was asked for; "after" it (the runner's pid never reached the agent); or "late": the
    request was in the zygote's pipe, and the fork comes half a second after the agent died."""

    def __init__(self, when: str) -> None:
        self.when, self.real = when, Starter()
        self.forking: threading.Thread | None = None

    async def start(self, request: dict[str, Any]) -> int:
        if self.when == "after":
            await self.real.start(request)
        elif self.when == "late":
            line = (json.dumps(request) + "\n").encode()

            def fork_late() -> None:
                time.sleep(0.5)
                self.real._start(line)

            self.forking = threading.Thread(target=fork_late)
            self.forking.start()
        raise asyncio.CancelledError  # the agent is gone here: nothing after this point runs

    def close(self) -> None:
        if self.forking is not None:
            self.forking.join()
        self.real.close()


ONCE = (  # marks that it ran, then prints three lines over 0.6 s
    "import sys, time\nopen(sys.argv[1], 'a').write('ran\\n')\n"
    "for i in range(3):\n    print(f'line {i}', flush=True)\n    time.sleep(0.2)\n"
)


def killed_while_starting(tmp_path: Path, when: str, ran: Path) -> None:
    """An agent that commits its state once per turn (here: never) is killed while it starts task t under
    lease l: what it left uncommitted is lost, as a killed process's transaction is."""

    async def scenario() -> None:
        bare = backend(tmp_path)
        bare.starter = KilledWhileStarting(when)  # type: ignore[assignment]
        bare.state.group_commits(lambda: None)
        bare.state.lease_begin("t", "l", 2)
        task = {**assignment("t", UNITS_PER_GPU, [sys.executable, "-c", ONCE, str(ran)]), "attempt": 2}
        with pytest.raises(asyncio.CancelledError):
            await bare.start(task, Recorder(bare.state))
        bare.state.rollback()
        bare.state.db.close()
        if when != "late":  # a late fork is the next agent's to wait for
            bare.starter.close()
        else:
            threading.Thread(target=bare.starter.close).start()

    asyncio.run(scenario())


def next_agent(tmp_path: Path) -> tuple[list[str], Recorder, BareMetal]:
    async def scenario() -> tuple[list[str], Recorder, BareMetal]:
        bare = backend(tmp_path)
        recorder = Recorder(bare.state)
        adopted = bare.adopt(recorder)
        if adopted:
            await asyncio.wait_for(recorder.finished.wait(), timeout=30)
        return adopted, recorder, bare

    return asyncio.run(scenario())


@pytest.mark.parametrize("when", ["after", "late"])
def test_a_runner_forked_as_its_agent_was_killed_is_taken_back_and_runs_once(
    tmp_path: Path, when: str
) -> None:
    """Its run never reached the state, but its record did before the fork: the next agent takes the
    runner back by the pid it wrote (waiting for a fork still on its way), under the run's lease, says it
    runs (that report was lost with the rest), reads every line once and reports the end."""
    ran = tmp_path / "ran"
    killed_while_starting(tmp_path, when, ran)
    adopted, recorder, bare = next_agent(tmp_path)
    assert adopted == ["t"]
    assert recorder.reports[0] == ("status", {"state": "running", "devices": [0]})
    assert recorder.lines() == ["line 0", "line 1", "line 2"]
    assert recorder.reports[-1] == (
        "result",
        {"exit_code": 0, "stopped": False, "outputs": [], "outputs_failed": []},
    )
    assert [(m["lease_id"], m["seq"]) for m in bare.state.pending()][:1] == [("l", 1)]  # its lease's reports
    assert ran.read_text() == "ran\n"  # once
    assert (bare.running(), bare.used) == ([], {0: 0})
    assert [slot.read_bytes() for slot in (tmp_path / "work" / FOLDER).iterdir()] == [b""]  # its record too


@pytest.mark.parametrize("record", ["whole", "cut short", "not JSON"])
def test_a_run_whose_runner_was_never_forked_is_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record: str
) -> None:
    """Killed before the fork (or while it wrote the record, which comes before the fork): no runner, so
    the next agent holds nothing of the task (the plane was never told it started, and offers it again),
    its GPU is free, and its record is gone."""
    monkeypatch.setattr("agents.records.FORK_SECONDS", 0.5)
    ran = tmp_path / "ran"
    killed_while_starting(tmp_path, "before", ran)
    written = tmp_path / "work" / FOLDER / "0"
    line = written.read_bytes()
    assert (json.loads(line)["lease_id"], line.count(b"\n")) == ("l", 1)  # whole, and no pid noted
    if record == "cut short":
        written.write_bytes(line[:40])
    elif record == "not JSON":
        written.write_bytes(b"\x00\xff\n")
    adopted, _, bare = next_agent(tmp_path)
    assert adopted == []
    assert (bare.running(), bare.state.lease("t"), bare.used) == ([], "", {})
    assert not ran.exists()
    assert written.read_bytes() == b""  # emptied, and the next start takes it
    assert bare.records.free == [written]


def test_a_record_of_a_run_in_the_state_is_read_from_the_state(tmp_path: Path) -> None:
    """A run committed to the state is taken back from it and not announced again; its record's slot is
    emptied when it ends, and taken by the next start."""
    ran = tmp_path / "ran"

    async def first() -> None:
        bare = backend(tmp_path)
        bare.state.lease_begin("t", "l", 1)
        await bare.start(
            assignment("t", UNITS_PER_GPU, [sys.executable, "-c", ONCE, str(ran)]), Recorder(bare.state)
        )
        for follower in list(bare.followers):
            follower.cancel()
        bare.starter.close()

    asyncio.run(first())
    adopted, recorder, bare = next_agent(tmp_path)
    assert adopted == ["t"]
    assert "status" not in [kind for kind, _ in recorder.reports]
    assert recorder.lines() == ["line 0", "line 1", "line 2"]
    assert ran.read_text() == "ran\n"
    assert (tmp_path / "work" / FOLDER / "0").read_bytes() == b""
    assert bare.records.free == [tmp_path / "work" / FOLDER / "0"]


def test_a_run_that_cannot_be_recorded_is_refused_for_now_and_not_started(tmp_path: Path) -> None:
    """Where the record cannot be written (a full disk; here its folder is a file), nothing is forked: the
    start is refused for now (the task waits for another try), and its GPU is free."""
    ran = tmp_path / "ran"
    bare = backend(tmp_path)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / FOLDER).write_text("in the way")

    async def scenario() -> None:
        with pytest.raises(Refused) as refused:
            await bare.start(
                assignment("t", UNITS_PER_GPU, [sys.executable, "-c", ONCE, str(ran)]), Recorder(bare.state)
            )
        assert not refused.value.permanent
        assert "could not record the task's run" in str(refused.value)

    asyncio.run(scenario())
    bare.starter.close()
    time.sleep(0.5)
    assert (bare.running(), bare.used, ran.exists()) == ([], {}, False)
