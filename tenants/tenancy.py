"""Running work in one tenant's schema, chosen explicitly, outside a request."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from celery import shared_task
from django_tenants.utils import tenant_context

from apps.core.logging import tenant_var
from tenants import due
from tenants.models import Tenant

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


def tenant_task(
    name: str, *, settles: str | None = None, **options: Any
) -> Callable[[Callable[..., R]], Any]:
    """Make a Celery task that takes a schema name first and runs `fn(tenant, ...)` inside that schema.

    Nothing is inherited from the connection a worker last used: the schema travels in the message. A
    tenant deleted after the task was sent is logged and skipped, so the task stays safe to retry. With
    `settles`, the task is that kind of periodic work (tenants/due.py): the tenant's mark is taken away
    before it runs and set again after if work of the kind is still due.
    """

    def decorate(fn: Callable[..., R]) -> Any:
        @shared_task(name=name, **options)
        @functools.wraps(fn)
        def run(schema_name: str, *args: Any, **kwargs: Any) -> R | None:
            tenant = Tenant.objects.filter(schema_name=schema_name).first()
            if tenant is None:
                logger.info("tenant gone; task skipped", extra={"task": name, "schema": schema_name})
                return None
            marker = tenant_var.set(tenant.slug)
            try:
                with tenant_context(tenant):
                    if settles is None:
                        return fn(tenant, *args, **kwargs)
                    return due.settle(schema_name, settles, lambda: fn(tenant, *args, **kwargs))  # type: ignore[return-value]
            finally:
                tenant_var.reset(marker)

        return run

    return decorate
