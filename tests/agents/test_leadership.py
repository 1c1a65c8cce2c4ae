"""Leader election over a coordination.k8s.io Lease, through the official client against the emulator
(which this suite's module gives the API server's resource versions and 409 Conflict): one holder at a
time, a standby that takes over only once the Lease went unrenewed for its whole duration on its own
clock, two candidates writing at once of which one wins, a holder cut off from the API server that
stops acting before a standby may take over, and a clean stop that hands over at once."""

from __future__ import annotations

import asyncio
import copy
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.kubernetes import Api, KubeSettings
from agents.leadership import Leadership
from agents.main import _backend, build_parser
from agents.state import JobRecord, State
from tests.agents.kube import NAMESPACE, Cluster


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster().start()
    yield running
    running.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(cluster: Cluster, **table: Any) -> KubeSettings:
    chosen = {"namespace": NAMESPACE, "api_url": cluster.url, "leader_election": True, **table}
    return KubeSettings.read({"agent": {"kubernetes": chosen}}, "GPU cluster 1")


def candidate(cluster: Cluster, identity: str, clock: Clock, **table: Any) -> Leadership:
    chosen = settings(cluster, **table)
    leadership = chosen.leadership(Api(chosen), identity)
    leadership.clock = clock
    return leadership


def lease(cluster: Cluster, name: str = "klique-agent-gpu-cluster-1") -> dict[str, Any]:
    assert cluster.emulator is not None
    return copy.deepcopy(cluster.emulator.leases[name])  # as read then, not as it becomes


def test_one_holder_and_a_standby_that_waits_out_the_lease_on_its_own_clock(cluster: Cluster) -> None:
    clock_a, clock_b = Clock(), Clock()
    clock_b.now = -5_000.0  # another node's clock: only differences on each clock count
    a, b = candidate(cluster, "pod-a-1", clock_a), candidate(cluster, "pod-b-1", clock_b)
    assert a.attempt()
    assert lease(cluster)["spec"]["holderIdentity"] == "pod-a-1"
    assert not b.attempt()
    for _ in range(5):  # a renews within the duration: b keeps standing by, however long that lasts
        clock_a.now += 10
        clock_b.now += 10
        assert a.attempt()
        assert not b.attempt()
    clock_b.now += 14.9  # a stopped renewing; b has seen it unchanged for less than 15 s
    assert not b.attempt()
    clock_b.now += 0.2
    assert b.attempt()
    held = lease(cluster)["spec"]
    assert (held["holderIdentity"], held["leaseTransitions"]) == ("pod-b-1", 1)
    clock_a.now += 30
    assert not a.attempt()  # a, back, sees b renewing: it does not take the Lease back
    assert a.holder == "pod-b-1"


def test_of_two_candidates_writing_at_once_one_wins(cluster: Cluster) -> None:
    clock = Clock()
    old, a, b = (candidate(cluster, name, clock) for name in ("pod-old", "pod-a", "pod-b"))
    assert old.attempt()
    assert not a.attempt()  # both see old's Lease
    assert not b.attempt()
    clock.now += 16  # and both see it expire
    stale = lease(cluster)
    b_api = b.api

    class ReadBeforeTheOther:  # b read the Lease just before a wrote it
        def lease_get(self, name: str) -> dict[str, Any] | None:
            return copy.deepcopy(stale)

        def __getattr__(self, name: str) -> Any:
            return getattr(b_api, name)

    b.api = ReadBeforeTheOther()
    assert a.attempt()
    assert not b.attempt()  # its write named the version a replaced: 409, so b stands by
    assert lease(cluster)["spec"]["holderIdentity"] == "pod-a"


def test_a_holder_cut_off_from_the_api_server_stops_before_a_standby_may_take_over(cluster: Cluster) -> None:
    a = candidate(cluster, "pod-a", Clock(), lease_seconds=3)
    b = candidate(cluster, "pod-b", Clock(), lease_seconds=3)
    a.clock = b.clock = time.monotonic  # real time: the renew loop sleeps
    assert a.attempt()
    emulator = cluster.emulator
    assert emulator is not None
    path = re.compile(r"/apis/coordination.k8s.io/.*")
    lost_at: list[float] = []

    async def scenario() -> float:
        emulator.refused.extend([("GET", path), ("PATCH", path)])  # a partition, as a's side sees it
        cut = a.clock()
        await asyncio.wait_for(a.keep(lambda: lost_at.append(a.clock())), 10)
        emulator.refused.clear()
        return cut

    cut = asyncio.run(scenario())
    assert lost_at
    assert lost_at[0] - cut <= a.lease_seconds  # stopped within the renew deadline (2 s)...
    assert lost_at[0] - cut >= a.renew_deadline_seconds - a.retry_seconds
    assert not b.attempt()  # ...while b, which first sees the Lease now, waits its whole duration


def test_a_clean_stop_hands_over_at_once(cluster: Cluster) -> None:
    clock = Clock()
    a, b = candidate(cluster, "pod-a", clock), candidate(cluster, "pod-b", clock)
    assert a.attempt()
    assert not b.attempt()
    a.release()
    assert b.attempt()
    assert lease(cluster)["spec"]["holderIdentity"] == "pod-b"


def test_a_standby_waits_in_lead_and_acts_once_the_holder_lets_go(cluster: Cluster) -> None:
    clock = Clock()
    a, b = candidate(cluster, "pod-a", clock), candidate(cluster, "pod-b", clock)
    b.retry_seconds = 0.05
    assert a.attempt()

    async def scenario() -> None:
        waiting = asyncio.create_task(b.lead())
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await asyncio.to_thread(a.release)
        await asyncio.wait_for(waiting, 5)

    asyncio.run(scenario())
    assert b.holder == "pod-b"


def test_the_agent_with_leader_election_holds_a_lease_named_for_it(cluster: Cluster, tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[agent.kubernetes]\nnamespace = "{NAMESPACE}"\napi_url = "{cluster.url}"\nleader_election = true\n'
    )
    argv = ["--url", "http://plane", "--backend", "kubernetes", "--config", str(config)]
    args = build_parser().parse_args([*argv, "--agent-id", "GPU_1", "--work-dir", str(tmp_path / "work")])
    backend = _backend(args)
    leadership = getattr(backend, "leadership", None)
    assert isinstance(leadership, Leadership)
    assert leadership.name == "klique-agent-gpu-1"
    assert leadership.attempt()
    config.write_text(config.read_text().replace("true", "false"))
    assert getattr(_backend(args), "leadership", "absent") is None


@pytest.mark.parametrize(
    ("table", "says"),
    [({"leader_election": "yes"}, "true or false"), ({"lease_seconds": 2}, "at least 3")],
)
def test_leader_election_settings_out_of_range_are_refused(
    cluster: Cluster, table: dict[str, Any], says: str
) -> None:
    def read_and_elect() -> None:
        chosen = settings(cluster, **table)
        chosen.leadership(Api(chosen), "pod")

    with pytest.raises((TypeError, ValueError), match=says):
        read_and_elect()


@pytest.mark.parametrize(
    ("backend", "table", "says"),
    [
        ("kubernetes", "", "--shared-state needs leader_election = true"),
        ("kubernetes", "leader_election = false\n", "--shared-state needs leader_election = true"),
        ("baremetal", "", "--shared-state is for the Kubernetes backend with leader election only"),
        ("slurm", "", "--shared-state is for the Kubernetes backend with leader election only"),
    ],
)
def test_shared_state_without_leader_election_is_refused(
    cluster: Cluster, tmp_path: Path, backend: str, table: str, says: str
) -> None:
    """Two agents opening one state at once would interleave their outboxes: sharing it needs the Lease."""
    config = tmp_path / "agent.toml"
    config.write_text(f'[agent.kubernetes]\nnamespace = "{NAMESPACE}"\napi_url = "{cluster.url}"\n{table}')
    argv = ["--url", "http://plane", "--backend", backend, "--config", str(config), "--gpus", "1"]
    args = build_parser().parse_args([*argv, "--work-dir", str(tmp_path / "work"), "--shared-state"])
    refused = _backend(args)
    assert isinstance(refused, str)
    assert says in refused
    assert not (tmp_path / "work" / "agent.sqlite").exists()


def test_the_state_is_opened_at_its_first_use_and_a_shared_one_keeps_a_rollback_journal(
    tmp_path: Path,
) -> None:
    local, shared = State(tmp_path / "local.sqlite"), State(tmp_path / "shared.sqlite", shared=True)
    assert not (tmp_path / "local.sqlite").exists()  # a standby has not touched it
    assert not (tmp_path / "shared.sqlite").exists()
    assert local.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert shared.db.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    shared.add_job(JobRecord("t", "k-t-1", "ml", "ada", kind="JobSet"))
    assert not list(tmp_path.glob("shared.sqlite-*"))  # no -wal or -shm file a second host would need
    assert State(tmp_path / "shared.sqlite", shared=True).jobs() == [
        JobRecord("t", "k-t-1", "ml", "ada", kind="JobSet")
    ]


def test_the_agent_with_leader_election_has_not_opened_its_state_when_made(
    cluster: Cluster, tmp_path: Path
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[agent.kubernetes]\nnamespace = "{NAMESPACE}"\napi_url = "{cluster.url}"\nleader_election = true\n'
    )
    argv = ["--url", "http://plane", "--backend", "kubernetes", "--config", str(config), "--shared-state"]
    args = build_parser().parse_args([*argv, "--work-dir", str(tmp_path / "work")])
    backend = _backend(args)
    assert not isinstance(backend, str)
    assert backend.state.shared is True
    assert not (tmp_path / "work" / "agent.sqlite").exists()
