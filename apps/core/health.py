"""What /readyz checks: the database answers, Redis answers, and no migration is waiting."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from django.conf import settings
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django_tenants.utils import get_public_schema_name, schema_context


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def check_database() -> Check:
    try:
        with schema_context(get_public_schema_name()), connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return Check("database", True, "PostgreSQL answers")
    except Exception as error:
        return Check(
            "database", False, f"PostgreSQL does not answer ({error.__class__.__name__}); check DATABASE_URL."
        )


def check_redis() -> Check:
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
        client.ping()
        client.close()
        return Check("redis", True, "Redis answers")
    except Exception as error:
        return Check("redis", False, f"Redis does not answer ({error.__class__.__name__}); check REDIS_URL.")


def check_migrations() -> Check:
    try:
        with schema_context(get_public_schema_name()):
            executor = MigrationExecutor(connection)
            pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except Exception as error:
        return Check("migrations", False, f"could not read migration state ({error.__class__.__name__})")
    if pending:
        names = ", ".join(f"{migration.app_label}.{migration.name}" for migration, _ in pending[:5])
        return Check("migrations", False, f"{len(pending)} pending ({names}); run `klique migrate`.")
    return Check("migrations", True, "up to date")


def readiness() -> list[Check]:
    database = check_database()
    checks = [database, check_redis()]
    checks.append(check_migrations() if database.ok else Check("migrations", False, "database unreachable"))
    return checks
