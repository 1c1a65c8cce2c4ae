"""The worker's watchdog (config/watchdog.py) against a real Redis: a consumer that takes nothing while its
queue holds messages and it has a free slot is found stalled after the stall time, and only then; a busy
worker, an empty queue, a message taken and a Redis that does not answer are not stalls. `klique up`'s
supervisor starts an ended worker again, a few times in a while at most."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery.signals import task_received, worker_ready
from django.conf import settings

from config import watchdog
from config.watchdog import PRIORITY_SEPARATOR, Watchdog, start
from klique.cli import ProcessSet, supervise
from tests.e2e.conftest import free_port

QUEUE = "klique-watchdog-test"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(settings.REDIS_URL)
    keys = [QUEUE, *(f"{QUEUE}{PRIORITY_SEPARATOR}{step}" for step in (3, 6, 9))]
    connection.delete(*keys)
    yield connection
    connection.delete(*keys)


def deaf_dog(client: redis.Redis, clock: Clock, busy: list[int], slots: int = 2) -> Watchdog:
    return Watchdog(client, [QUEUE], slots, lambda: busy[0], stall_seconds=60, clock=clock)


def test_a_consumer_deaf_to_waiting_messages_is_stalled_after_the_stall_time(client: redis.Redis) -> None:
    clock, busy = Clock(), [0]
    dog = deaf_dog(client, clock, busy)
    client.rpush(QUEUE, b"message")
    assert not dog.check()  # seen now: the stall time starts
    clock.now += 59
    assert not dog.check()
    clock.now += 1
    assert dog.check()


def test_a_message_taken_starts_the_stall_time_again(client: redis.Redis) -> None:
    clock, busy = Clock(), [0]
    dog = deaf_dog(client, clock, busy)
    client.rpush(QUEUE, b"one", b"two")
    assert not dog.check()
    clock.now += 50
    dog.received()  # a slow consumer, but a live one
    assert not dog.check()
    clock.now += 59
    assert not dog.check()
    clock.now += 1
    assert dog.check()


@pytest.mark.parametrize("case", ["busy", "empty", "emptied", "no redis"])
def test_what_is_not_a_stall(client: redis.Redis, case: str) -> None:
    clock, busy = Clock(), [0]
    dog = deaf_dog(client, clock, busy)
    if case == "busy":  # every slot taken by long tasks: messages wait, rightly
        busy[0] = 2
        client.rpush(QUEUE, b"waits")
    elif case == "emptied":  # another worker took them
        client.rpush(QUEUE, b"taken elsewhere")
        assert not dog.check()
        clock.now += 30
        client.delete(QUEUE)
    elif case == "no redis":  # the broker does not answer: the consumer cannot take anything either
        dog.client = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    for _ in range(3):
        assert not dog.check()
        clock.now += 60
    assert not dog.check()


def test_messages_of_any_priority_count(client: redis.Redis) -> None:
    clock, busy = Clock(), [1]
    dog = deaf_dog(client, clock, busy)
    client.rpush(f"{QUEUE}{PRIORITY_SEPARATOR}6", b"urgent")
    assert dog.waiting() == 1
    assert not dog.check()
    clock.now += 60
    assert dog.check()


def test_the_thread_calls_for_the_end_of_a_stalled_worker(client: redis.Redis) -> None:
    client.rpush(QUEUE, b"never taken")
    dog = Watchdog(client, [QUEUE], 1, lambda: 0, stall_seconds=0.3)
    ended = threading.Event()
    thread = start(dog, check_seconds=0.05, exit_grace_seconds=0, on_stall=lambda _: ended.set())
    assert ended.wait(5)
    thread.join(5)
    assert not thread.is_alive()  # it calls once, then leaves


def test_the_supervisor_starts_an_ended_child_again_a_few_times_at_most(tmp_path: Path) -> None:
    counter = tmp_path / "starts"
    argv = [sys.executable, "-c", f"open({str(counter)!r}, 'a').write('x')"]
    children = ProcessSet()
    children.RESTARTS, children.RESTART_WINDOW_SECONDS = 2, 60.0
    try:
        children.start("worker", argv)
        for expected in (True, True, False):  # the third end within the window: it cannot run
            children.children["worker"].wait(10)
            assert children.first_exited() == "worker"
            assert children.restart("worker") is expected
        children.children["worker"].wait(10)
        assert counter.read_text() == "xxx"
    finally:
        children.stop(grace_seconds=2)


def test_restarts_long_ago_do_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    children = ProcessSet()
    children.RESTARTS = 1
    children.start("beat", [sys.executable, "-c", "pass"])
    try:
        children.children["beat"].wait(10)
        assert children.restart("beat")
        children.children["beat"].wait(10)
        later = time.monotonic() + children.RESTART_WINDOW_SECONDS + 1
        monkeypatch.setattr(time, "monotonic", lambda: later)
        assert children.restart("beat")
    finally:
        children.stop(grace_seconds=2)


def test_every_worker_gets_a_watchdog_of_its_queues_and_slots(
    client: redis.Redis, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What Celery's worker_ready hands over: the consumer, whose pool says how many slots it has."""
    started: list[Watchdog] = []
    monkeypatch.setattr(watchdog, "start", lambda dog, **_: started.append(dog))
    consumer = SimpleNamespace(pool=SimpleNamespace(num_processes=3))
    settings.KLIQUE_WORKER_STALL_SECONDS = 45
    dog = watchdog.install(consumer, settings.REDIS_URL, [QUEUE], settings)
    assert dog is not None
    assert started == [dog]
    assert (dog.slots, dog.stall_seconds, dog.keys[0]) == (3, 45.0, QUEUE)
    client.rpush(QUEUE, b"waiting")
    assert dog.waiting() == 1
    assert dog.busy() == 0

    settings.KLIQUE_WORKER_STALL_SECONDS = 0  # turned off
    assert watchdog.install(consumer, settings.REDIS_URL, [QUEUE], settings) is None
    assert worker_ready.receivers
    assert task_received.receivers


@pytest.mark.parametrize(("name", "code"), [("worker", 75), ("agent", 74)])
def test_up_starts_an_ended_worker_or_agent_again_and_stops_when_it_cannot_run(
    capsys: pytest.CaptureFixture[str], name: str, code: int
) -> None:
    children = ProcessSet()
    children.RESTARTS = 2
    children.start(name, [sys.executable, "-c", f"raise SystemExit({code})"])
    try:
        assert supervise(children, lambda: False) is True  # ended three times: it cannot run
    finally:
        children.stop(grace_seconds=2)
    said = capsys.readouterr().err
    assert said.count(f"The {name} process ended (exit code {code}); starting it again.") == 2
    assert f"The {name} process stopped (exit code {code}); stopping the others." in said


def test_up_does_not_start_again_what_it_does_not_own(capsys: pytest.CaptureFixture[str]) -> None:
    children = ProcessSet()
    children.start("model", [sys.executable, "-c", "pass"])  # the demo's model server: not restarted
    try:
        assert supervise(children, lambda: False) is True
    finally:
        children.stop(grace_seconds=2)
    assert "starting it again" not in capsys.readouterr().err
