"""`klique migrate` (tenants/migrate.py): a new migration reaches every tenant schema through parallel
processes; a schema that fails is named and the others are done; the next run resumes with only what is
left, and skips schemas already up to date."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django_tenants.utils import schema_context

from apps.provider.services import tenant_create, tenant_delete
from tenants.migrate import migrate_all, pending
from tenants.models import Tenant
from tests.world import World

SLUGS = ("mig-a", "mig-b", "mig-c", "mig-d")
LATEST = ("scheduling", "0013_task_changes")  # it adds the column scheduling_task.changed_xid
BEFORE_LATEST = "0012"


def unapplied_after(before: str) -> int:
    """How many of the scheduling migrations on disk come after `before` (0013 and any later one)."""
    names = MigrationLoader(None, ignore_no_migrations=True).disk_migrations
    return sum(1 for app, name in names if app == "scheduling" and name[:4] > before)


def schema_of(slug: str) -> str:
    return str(Tenant.objects.get(slug=slug).schema_name)


def has_latest(schema: str) -> bool:
    with connection.cursor() as cursor:
        table = f"{connection.ops.quote_name(schema)}.django_migrations"  # a test's own schema
        cursor.execute(f"SELECT 1 FROM {table} WHERE app = %s AND name = %s", list(LATEST))  # noqa: S608
        return cursor.fetchone() is not None


def squat(schema: str, *, leave: bool = False) -> None:
    """Put in the way what the latest migration creates (or take it away)."""
    with schema_context(schema), connection.cursor() as cursor:
        if leave:
            cursor.execute("ALTER TABLE scheduling_task DROP COLUMN changed_xid")
        else:
            cursor.execute("ALTER TABLE scheduling_task ADD COLUMN changed_xid int")


@pytest.fixture
def schemas(world: World, django_db_blocker: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Four committed tenants whose schemas lack the latest scheduling migration, as after a deploy that
    brings a new one (it is unapplied: its table dropped, its record gone)."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        for slug in SLUGS:
            tenant_create(slug=slug, name=slug, admin_username="mia")
        names = [schema_of(slug) for slug in SLUGS]
        for name in names:
            call_command(
                "migrate_schemas", "scheduling", BEFORE_LATEST, schema_name=name, tenant=True, verbosity=0
            )
        yield names
        for slug in SLUGS:
            tenant_delete(tenant=Tenant.objects.get(slug=slug))


def test_a_new_migration_reaches_every_schema_and_a_failed_one_is_named_then_resumed(
    schemas: list[str], django_db_blocker: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        assert set(pending(schemas)) == set(schemas)
        assert pending(schemas) == dict.fromkeys(schemas, unapplied_after(BEFORE_LATEST))
        broken = schemas[1]
        squat(broken)

        lines: list[str] = []
        summary = migrate_all(processes=2, progress=lines.append)

        assert [failed.schema for failed in summary.failed] == [broken]
        assert "changed_xid" in summary.failed[0].error
        assert "already exists" in summary.failed[0].error
        assert {schema: has_latest(schema) for schema in schemas} == {
            schema: schema != broken for schema in schemas
        }
        # Progress: a line per schema, the failed one named with its error.
        assert lines[0].endswith(
            f"{len(schemas)} of {summary.up_to_date + len(schemas)} tenant schemas have migrations to apply"
        )
        assert sorted(line.split("] ")[1].split(":")[0] for line in lines[1:]) == sorted(schemas)
        assert any(line.startswith("[") and f"{broken}: FAILED: ProgrammingError" in line for line in lines)
        assert set(pending(schemas)) == {broken}  # the other schemas are done

        capsys.readouterr()
        with pytest.raises(CommandError, match=rf"(?s)not migrated.*{broken}: ProgrammingError.*again"):
            call_command("migrate_tenants", processes=2)  # still broken: named, and the command fails
        assert f"{broken}: FAILED" in capsys.readouterr().out
        squat(broken, leave=True)

        resumed: list[str] = []
        again = migrate_all(processes=2, progress=resumed.append)
        assert [migrated.schema for migrated in again.migrated] == [broken]  # only what was left
        assert again.failed == []
        assert all(has_latest(schema) for schema in schemas)
        assert pending(schemas) == {}

        call_command("migrate_tenants", processes=2)  # nothing left: every schema skipped, no error
        out = capsys.readouterr().out
        assert "0 tenant schemas migrated" in out
        assert "schema template for new tenants: ready" in out  # built now, not by the first new tenant


def test_processes_must_be_one_or_more(db: None) -> None:
    with pytest.raises(CommandError, match="1 or more"):
        call_command("migrate_tenants", processes=0)
