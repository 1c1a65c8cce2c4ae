"""Sending a Celery task (a cycle request from a web request, a tenant fan-out from a worker) touches the
broker's queue and nothing else: no result channel is subscribed, so the sender gathers nothing it never
reads, and while Redis is away a send fails within seconds instead of stalling in a reconnect."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from django.conf import settings
from kombu.exceptions import OperationalError

from apps.scheduling import wake
from config.celery import app as klique_app


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # nothing listens once the probe is closed


def app_with_broker(url: str) -> Celery:
    """Klique's own Celery configuration, pointed at another Redis (a result backend too, if it kept one)."""
    app = Celery("klique-under-test", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    app.conf.update(broker_url=url)
    if app.conf.result_backend:
        app.conf.update(result_backend=url)
    return app


@pytest.fixture
def queue() -> Iterator[str]:
    """A queue of the test's own, so that no running worker takes what it sends."""
    name = f"klique-test-{uuid.uuid4().hex[:12]}"
    yield name
    redis.Redis.from_url(settings.REDIS_URL).delete(name)


def test_klique_keeps_no_task_results() -> None:
    assert klique_app.conf.result_backend is None
    assert klique_app.conf.task_ignore_result is True
    assert type(klique_app.backend).__name__ == "DisabledBackend"


@pytest.mark.parametrize("name", [wake.CYCLE_TASK, "tenants.for_each_tenant", "metering.storage"])
def test_a_send_subscribes_to_no_result_channel(name: str, queue: str) -> None:
    client = redis.Redis.from_url(settings.REDIS_URL)
    sent = klique_app.send_task(name, args=("acme",), queue=queue)
    assert client.llen(queue) == 1  # the message is on the broker
    channel = f"celery-task-meta-{sent.id}"
    assert client.pubsub_numsub(channel) == [(channel.encode(), 0)]
    assert client.get(channel) is None


@pytest.mark.parametrize("countdown", [None, 0.0, 5.0])
def test_a_send_while_redis_is_away_fails_in_seconds(countdown: float | None, queue: str) -> None:
    app = app_with_broker(f"redis://127.0.0.1:{closed_port()}/0")
    started = time.monotonic()
    with pytest.raises(OperationalError):
        app.send_task(wake.CYCLE_TASK, args=("acme",), countdown=countdown, queue=queue)
    assert time.monotonic() - started < 5  # the publish retry policy, not a result channel's reconnect
