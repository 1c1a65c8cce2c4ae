"""The Celery application: `klique worker` and `klique beat` run it."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")

app = Celery("klique")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(
    ["tenants", "apps.accounts", "apps.scheduling", "apps.fleet", "apps.catalogue", "apps.billing", "gateway"]
)
