"""`klique migrate`: the public schema first, then every tenant schema that has a migration to apply, in
parallel processes, each schema on its own.

A schema that fails is named with its error and does not stop the others; the command then exits non-zero.
Every migration of a schema is applied in its own transaction (PostgreSQL's DDL is transactional), so a
failure leaves that schema at its last whole migration, and running the command again resumes: schemas
already up to date are skipped after one query each, and only the failed ones and those not reached are
migrated. Progress is a line per schema as it ends.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.core.management import call_command
from django.db import connection, connections
from django.db.migrations.loader import MigrationLoader
from django_tenants.utils import get_public_schema_name, get_tenant_model

DEFAULT_PROCESSES = 4


@dataclass(frozen=True)
class Migrated:
    schema: str
    pending: int  # migrations it lacked before
    seconds: float
    error: str = ""  # empty when it is up to date now


@dataclass(frozen=True)
class Summary:
    migrated: list[Migrated]
    up_to_date: int  # schemas that needed nothing

    @property
    def failed(self) -> list[Migrated]:
        return [schema for schema in self.migrated if schema.error]


def default_processes() -> int:
    """KLIQUE_MIGRATE_PROCESSES, or the host's CPUs up to DEFAULT_PROCESSES."""
    configured = os.environ.get("KLIQUE_MIGRATE_PROCESSES", "").strip()
    if configured:
        return max(1, int(configured))
    return max(1, min(DEFAULT_PROCESSES, os.cpu_count() or 1))


def pending(schemas: Iterable[str]) -> dict[str, int]:
    """Each of `schemas` that lacks a migration on disk, and how many it lacks (one query for the schemas
    that record migrations, then one a schema)."""
    known = set(MigrationLoader(None, ignore_no_migrations=True).graph.nodes)
    lacking = {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_schema FROM information_schema.tables WHERE table_name = 'django_migrations'"
        )
        recorded = {schema for (schema,) in cursor.fetchall()}
        for schema in schemas:
            applied: set[tuple[str, str]] = set()
            if schema in recorded:  # a name from the tenants table, quoted
                cursor.execute(f"SELECT app, name FROM {connection.ops.quote_name(schema)}.django_migrations")  # noqa: S608
                applied = {(app, name) for app, name in cursor.fetchall()}
            missing = len(known - applied)
            if missing:
                lacking[schema] = missing
    return lacking


def _migrate_schema(job: tuple[str, int]) -> Migrated:
    """In a worker process: migrate one tenant schema, and say how it went (never raise)."""
    schema, lacking = job
    started = time.perf_counter()
    error = ""
    try:
        call_command(
            "migrate_schemas",
            tenant=True,
            schema_name=schema,
            interactive=False,
            verbosity=0,
            executor="standard",
        )
    except Exception as failure:  # the schema is named with its error; the others go on
        first_line = (str(failure).strip().splitlines() or [""])[0]
        error = f"{type(failure).__name__}: {first_line}"
    finally:
        connections.close_all()
    return Migrated(schema, lacking, time.perf_counter() - started, error)


def migrate_all(*, processes: int | None = None, progress: Callable[[str], None] = print) -> Summary:
    """Migrate the public schema, then every tenant schema lacking a migration, `processes` at a time."""
    call_command("migrate_schemas", shared=True, interactive=False, verbosity=0)
    public = get_public_schema_name()
    tenants = get_tenant_model().objects.exclude(schema_name=public).order_by("schema_name")
    schemas = list(tenants.values_list("schema_name", flat=True))
    lacking = pending(schemas)
    progress(
        f"public schema migrated; {len(lacking)} of {len(schemas)} tenant schemas have migrations to apply"
    )
    if not lacking:
        return Summary([], len(schemas))
    connections.close_all()  # each worker opens its own; a forked connection would be shared
    done: list[Migrated] = []
    workers = max(1, min(processes or default_processes(), len(lacking)))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for migrated in pool.imap_unordered(_migrate_schema, lacking.items()):
            done.append(migrated)
            state = f"FAILED: {migrated.error}" if migrated.error else f"{migrated.pending} applied"
            progress(f"[{len(done)}/{len(lacking)}] {migrated.schema}: {state} ({migrated.seconds:.1f} s)")
    return Summary(sorted(done, key=lambda migrated: migrated.schema), len(schemas) - len(lacking))
