"""The worker's watchdog: a worker whose consumer has stopped taking messages ends, so that it is started
again, instead of sitting alive and deaf while its queue fills.

Celery's Redis transport can lose its consumer when Redis restarts under it: the worker stays up, logs
nothing more, and never takes another message (celery/celery#8030, #9054, #10302 and others). Everything
Klique's worker does is then silently not done: no cycle, no walk, no metering.

The watchdog asks the broker itself. It is **stalled** when, for `stall_seconds` in a row:

- the worker's queues hold messages (a Redis that does not answer says nothing: not counted);
- the worker has a free slot (a worker busy with long tasks leaves messages waiting, rightly);
- the consumer has received nothing.

A stalled worker says so in its log and shuts down warmly (SIGTERM: its running tasks end first); if it
is still up after `exit_grace_seconds`, it leaves at once. Nothing is lost: tasks are acknowledged late,
so a message taken and not finished is delivered again. `klique up` starts an ended worker again, and so
does any supervisor in production (the chart's Deployment restarts the pod).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from celery.worker import state

logger = logging.getLogger(__name__)

# kombu's Redis transport keeps a queue's messages of priority p (>0) under "<queue>\x06\x16<p>".
PRIORITY_SEPARATOR = "\x06\x16"
STEPS = (0, 3, 6, 9)
EXIT_STALLED = 75  # EX_TEMPFAIL: try again


def queue_keys(queues: Sequence[str]) -> list[str]:
    return [queue if not step else f"{queue}{PRIORITY_SEPARATOR}{step}" for queue in queues for step in STEPS]


class Watchdog:
    """Decides, one check at a time, whether the consumer has stalled; the thread in `start` runs it."""

    def __init__(
        self,
        client: redis.Redis,
        queues: Sequence[str],
        slots: int,
        busy: Callable[[], int],
        *,
        stall_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.keys, self.slots, self.busy = client, queue_keys(queues), slots, busy
        self.stall_seconds, self.clock = stall_seconds, clock
        self.since: float | None = None  # since when it has looked deaf; None: it does not now

    def received(self) -> None:
        """The consumer took a message (Celery's task_received signal): it is not deaf."""
        self.since = None

    def waiting(self) -> int | None:
        """Messages waiting in the worker's queues; None when Redis does not answer."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in self.keys:
                pipe.llen(key)
            return sum(int(length) for length in pipe.execute())
        except redis.RedisError:
            return None

    def check(self) -> bool:
        """One look; True once the consumer has been deaf for `stall_seconds`."""
        now = self.clock()
        waiting = self.waiting()
        if not waiting or self.busy() >= self.slots:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.stall_seconds


def end_worker(exit_grace_seconds: float) -> None:
    """Shut this worker down warmly, and leave at once if it is still up after the grace."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(exit_grace_seconds)
    logger.error("the stalled worker did not stop within %.0f s; leaving at once", exit_grace_seconds)
    logging.shutdown()
    os._exit(EXIT_STALLED)


def start(
    watchdog: Watchdog,
    *,
    check_seconds: float,
    exit_grace_seconds: float,
    on_stall: Callable[[float], None] = end_worker,
) -> threading.Thread:
    """Check every `check_seconds` in a daemon thread; on a stall, log why and call `on_stall`."""

    def run() -> None:
        while True:
            time.sleep(check_seconds)
            try:
                stalled = watchdog.check()
            except Exception:  # the watchdog must never end the worker by its own fault
                logger.exception("the worker's watchdog could not check its queues")
                continue
            if stalled:
                logger.error(
                    "this worker has taken no message for %.0f s while its queues hold some and it has a "
                    "free slot: its connection to the broker is lost. Ending it so that it is started "
                    "again; nothing is lost (tasks are acknowledged when done)",
                    watchdog.stall_seconds,
                )
                on_stall(exit_grace_seconds)
                return

    thread = threading.Thread(target=run, name="klique-worker-watchdog", daemon=True)
    thread.start()
    return thread


def install(sender: Any, broker_url: str, queues: Sequence[str], settings: Any) -> Watchdog | None:
    """Start the watchdog for the worker whose consumer is `sender` (Celery's worker_ready)."""
    stall = float(settings.KLIQUE_WORKER_STALL_SECONDS)
    if stall <= 0:
        return None
    slots = int(getattr(getattr(sender, "pool", None), "num_processes", 0) or sender.controller.concurrency)
    client = redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=5)
    watchdog = Watchdog(client, queues, slots, lambda: len(state.reserved_requests), stall_seconds=stall)
    start(watchdog, check_seconds=min(5.0, stall / 4), exit_grace_seconds=30.0)
    return watchdog
