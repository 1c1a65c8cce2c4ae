"""The Celery application: `klique worker` and `klique beat` run it."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import task_received, worker_ready
from django.conf import settings

from config import watchdog

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")

_watchdog: watchdog.Watchdog | None = None

app = Celery("klique")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(
    ["tenants", "apps.accounts", "apps.scheduling", "apps.fleet", "apps.catalogue", "apps.billing", "gateway"]
)


@worker_ready.connect
def _watch_the_consumer(sender: Any, **_: Any) -> None:
    """A worker whose consumer stops taking messages (a Redis restart under it) ends to be started again."""
    queues = [queue.name for queue in sender.task_consumer.queues]
    global _watchdog  # noqa: PLW0603 -- one per worker process
    _watchdog = watchdog.install(sender, app.conf.broker_url, queues, settings)


@task_received.connect
def _message_taken(**_: Any) -> None:
    if _watchdog is not None:
        _watchdog.received()
