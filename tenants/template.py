"""A new tenant's schema from a template instead of from every migration.

Migrating an empty schema runs every migration of every tenant app one by one (seconds a tenant, and more
as migrations accumulate). Instead, the migrations are run once, on a schema of their own
(`_klique_template`), and that schema is dumped with `pg_dump` into SQL: tables, sequences, indexes,
constraints and the rows the migrations leave (their own `django_migrations` records among them). The SQL is
kept in the public table `tenants_schematemplate` under a fingerprint of the migrations on disk (their names
and file contents), and a new tenant's schema is made by replaying it under the tenant's name, inside the
same transaction as the tenant's row. So the schema is exactly what migrating would have made, and it is
known to be current: a new or changed migration changes the fingerprint, and the next tenant created builds
the template afresh.

The build runs once per set of migrations, in a thread of its own so that it commits on its own connection
whatever transaction the caller is in (pg_dump, a separate process, sees only committed schemas). Where it
cannot be built (no `pg_dump` here, a server newer than it, or `KLIQUE_SCHEMA_TEMPLATE=0`), tenants
are created by migrating, as before, and the log says why once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django_tenants.utils import get_public_schema_name, schema_context

from tenants.models import SchemaTemplate

logger = logging.getLogger(__name__)

# No tenant can have this schema: tenant schemas come from slugs, which start with a letter.
TEMPLATE_SCHEMA = "_klique_template"
_LOCK = 0x6B6C7174  # advisory lock key: one build at a time across processes
_KEEP = 5  # templates kept (a rolling deployment may still create tenants with the previous set)
_QUALIFIED = re.compile(rf"(?<![\w\"]){TEMPLATE_SCHEMA}(?=[.;])")  # a qualified name, or the schema made
_NAMED = re.compile(rf"(?<!\w){TEMPLATE_SCHEMA}(?!\w)")  # the name anywhere else: in a string, quoted...
# Whole lines of the dump left out: session settings, psql's meta-commands, comments.
_SKIPPED = re.compile(r"SET [a-z_]+ = .*;|SELECT pg_catalog\.set_config\(.*\);|\\.*|--.*")
_built: dict[str, str] = {}  # fingerprint -> SQL, once read in this process
_warned: set[str] = set()
_failed_at: dict[str, float] = {}  # fingerprint -> when its build last failed in this process
RETRY_SECONDS = 600.0  # a build that failed is tried again after this long


class TemplateUnavailable(Exception):
    """The template cannot be built here; the message says why."""


@functools.cache
def fingerprint() -> tuple[str, int]:
    """A digest of the migrations on disk (app, name and the file's bytes of each), and how many there are."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    digest = hashlib.sha256()
    for key in sorted(loader.disk_migrations):
        module = sys.modules[type(loader.disk_migrations[key]).__module__]
        digest.update(f"{key[0]}.{key[1]}\n".encode())
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest(), len(loader.disk_migrations)


def schema_sql(schema_name: str) -> str | None:
    """The SQL that makes `schema_name` as a migrated tenant schema, building the template first if the
    migrations on disk have none yet; None when no template can be had here (migrate the schema instead)."""
    sql = _template_sql()
    return None if sql is None else rename(sql, schema_name)


def ensure() -> bool:
    """Build the template of the migrations on disk if there is none yet (as `klique migrate` does after a
    deploy, so that the first new tenant does not wait for it); whether one is ready."""
    return _template_sql() is not None


def _template_sql() -> str | None:
    if not settings.KLIQUE_SCHEMA_TEMPLATE:
        return None
    key, count = fingerprint()
    sql = _built.get(key)
    if sql is None:
        with schema_context(get_public_schema_name()):
            sql = SchemaTemplate.objects.filter(fingerprint=key).values_list("sql", flat=True).first()
        if sql is None:
            failed = _failed_at.get(key)
            if failed is not None and time.monotonic() - failed < RETRY_SECONDS:
                return None  # each creation would otherwise migrate the template again, and fail again
            sql = _build_apart(key, count)
        if sql is None:
            _failed_at[key] = time.monotonic()
            return None
        _built[key] = sql
    return sql


def rename(sql: str, schema_name: str) -> str:
    """The template's SQL for a schema named `schema_name` (a tenant's name: letters, digits and _)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,62}", schema_name):
        raise ValueError(f"{schema_name!r} is not a tenant schema name")
    return _QUALIFIED.sub(f'"{schema_name}"', sql)


def _build_apart(key: str, count: int) -> str | None:
    """Build the template in a thread of its own (its own connection, committed whatever the caller's
    transaction); None, logged once, when it cannot be built."""
    result: list[str] = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            result.append(build(key, count))
        except BaseException as error:  # reported below, in the caller's thread
            failure.append(error)
        finally:
            connection.close()

    thread = threading.Thread(target=work, name="klique-schema-template", daemon=True)
    thread.start()
    thread.join()
    if result:
        return result[0]
    reason = f"{type(failure[0]).__name__}: {failure[0]}" if failure else "no result"
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(
            "new tenant schemas are migrated one by one: the schema template cannot be built",
            extra={"reason": reason},
        )
    return None


def build(key: str, count: int) -> str:
    """Migrate the template schema, dump it and keep the SQL under `key` (or return the one another process
    kept meanwhile). Run on a connection outside any transaction: the dump reads committed schemas only."""
    with schema_context(get_public_schema_name()):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [_LOCK])
        try:
            kept = SchemaTemplate.objects.filter(fingerprint=key).values_list("sql", flat=True).first()
            if kept is not None:
                return kept
            _drop_template()
            with connection.cursor() as cursor:
                cursor.execute(f"CREATE SCHEMA {TEMPLATE_SCHEMA}")
            try:
                call_command(
                    "migrate_schemas",
                    tenant=True,
                    schema_name=TEMPLATE_SCHEMA,
                    interactive=False,
                    verbosity=0,
                    executor="standard",
                )
                sql = replayable(dump(TEMPLATE_SCHEMA))  # pg_dump reads the connection's settings only
            finally:
                connection.set_schema_to_public()  # type: ignore[attr-defined]
                _drop_template()
            SchemaTemplate.objects.create(fingerprint=key, sql=sql, migrations=count)
            stale = SchemaTemplate.objects.order_by("-created_at", "-pk").values_list("pk", flat=True)[_KEEP:]
            SchemaTemplate.objects.filter(pk__in=list(stale)).delete()
            logger.info("schema template built", extra={"migrations": count, "bytes": len(sql)})
            return sql
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [_LOCK])


def _drop_template() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DROP SCHEMA IF EXISTS {TEMPLATE_SCHEMA} CASCADE")


def pg_dumps() -> list[str]:
    """The pg_dump programs to try, newest first: the one of the embedded PostgreSQL (`pgserver`, what
    `klique up` and `make test` run where no server is configured), then the host's. A pg_dump refuses a
    server newer than itself, and dumps older ones."""
    found = []
    embedded = importlib.util.find_spec("pgserver")
    if embedded is not None and embedded.origin:
        bundled = Path(embedded.origin).parent / "pginstall" / "bin" / "pg_dump"
        if bundled.is_file():
            found.append(str(bundled))
    host = shutil.which("pg_dump")
    if host is not None:
        found.append(host)
    return found


def dump(schema: str) -> str:
    """`pg_dump` of one schema as plain SQL with row inserts, read with this connection's settings, by the
    first of `pg_dumps()` that can. The process gets only PATH and the libpq settings (the password among
    them, never on its command line)."""
    programs = pg_dumps()
    if not programs:
        raise TemplateUnavailable("pg_dump is not installed on this host")
    failures = []
    for program in programs:
        try:
            return _dump_with(program, schema)
        except TemplateUnavailable as failure:
            failures.append(str(failure))
    raise TemplateUnavailable("; ".join(failures))


def _dump_with(program: str, schema: str) -> str:
    database = connection.settings_dict
    options = database.get("OPTIONS") or {}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for variable, value in (
        ("PGHOST", database.get("HOST")),
        ("PGPORT", database.get("PORT")),
        ("PGUSER", database.get("USER")),
        ("PGPASSWORD", database.get("PASSWORD")),
        ("PGDATABASE", database.get("NAME")),
        ("PGSSLMODE", options.get("sslmode")),
    ):
        if value:
            env[variable] = str(value)
    done = subprocess.run(  # noqa: S603 (a fixed program and arguments)
        [program, "--schema", schema, "--no-owner", "--no-privileges", "--no-tablespaces", "--inserts"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise TemplateUnavailable(f"pg_dump failed ({program}): {done.stderr.strip()[-500:]}")
    return done.stdout


def replayable(dumped: str) -> str:
    """The dump without its session settings, psql commands and comments (the replay runs on a live
    connection whose search path must stay as it is); refused if the template's name is left anywhere
    renaming would not reach."""
    sql = "\n".join(line for line in dumped.splitlines() if line.strip() and not _SKIPPED.fullmatch(line))
    if f"CREATE SCHEMA {TEMPLATE_SCHEMA};" not in sql:
        raise TemplateUnavailable("the dump does not create the template schema")
    if _NAMED.search(_QUALIFIED.sub("", sql)):
        raise TemplateUnavailable("the dump names the template schema where renaming would not reach")
    return sql
