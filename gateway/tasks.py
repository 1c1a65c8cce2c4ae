"""Periodic work for the gateway: usage rows that waited in Redis, holds whose process died, and its calls
into the ledger."""

from __future__ import annotations

import logging

from celery import shared_task
from django.db import connection
from django_tenants.utils import get_public_schema_name, schema_context

from gateway import budgets, services
from gateway.cache import USAGE_OUTBOX, UsageRow, insert_sql, sync_redis
from tenants import due
from tenants.models import Tenant
from tenants.tenancy import tenant_task

log = logging.getLogger("klique.gateway")
DRAIN_BATCH = 500


@shared_task(name="gateway.drain_usage_outbox")
def drain_usage_outbox() -> int:
    """Write usage rows that PostgreSQL could not take when their call ended (idempotent by request id)."""
    redis = sync_redis()
    written = 0
    while raw := redis.lrange(USAGE_OUTBOX, 0, DRAIN_BATCH - 1):
        schemas = set()
        with connection.cursor() as cursor:
            for text in raw:
                schema, row = UsageRow.from_json(text.decode())
                cursor.execute(insert_sql(schema, 1).as_string(cursor.connection), row.values())
                schemas.add(schema)
        due.mark(schemas, "gateway_calls")
        redis.ltrim(USAGE_OUTBOX, len(raw), -1)
        written += len(raw)
    return written


@shared_task(name="gateway.sweep_holds")
def sweep_holds() -> int:
    """Give back budget holds of calls whose gateway process died before settling them: in the tenants
    that hold any (budgets.HOLDING), not in every tenant."""

    def every_schema() -> list[str]:
        with schema_context(get_public_schema_name()):
            public = get_public_schema_name()
            return list(Tenant.objects.exclude(schema_name=public).values_list("schema_name", flat=True))

    released = budgets.sweep_all(sync_redis(), every_schema)
    if released:
        log.warning("released %d budget holds of calls that never settled", released)
    return released


due.predicate("gateway_calls")(services.calls_to_meter)


@tenant_task("metering.gateway_calls", settles="gateway_calls")
def meter_calls(tenant: Tenant) -> int:
    """The gateway's calls since the last run, into the ledger; how many were new."""
    return services.meter_calls().accepted
