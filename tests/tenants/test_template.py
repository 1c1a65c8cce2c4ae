"""New tenant schemas from the schema template (tenants/template.py): the schema replayed is the schema
migrating makes; the template follows the migrations on disk; without pg_dump, tenants are migrated as
before; renaming reaches every name of the template and nothing else."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
from django.db import connection
from django.test import override_settings
from rest_framework.test import APIClient

from apps.core.errors import Conflict
from apps.provider.services import tenant_create
from tenants import template
from tenants.models import SchemaTemplate, Tenant
from tests.world import World


def catalog(schema: str) -> dict[str, list[tuple[object, ...]]]:
    """What a schema holds, with its own name taken out: columns, indexes, constraints, sequences and the
    migrations it records."""
    queries = {
        # Columns in their order (a migrated table keeps gaps where columns were dropped).
        "columns": """SELECT table_name, column_name, data_type, is_nullable, column_default,
                row_number() OVER (PARTITION BY table_name ORDER BY ordinal_position)
            FROM information_schema.columns WHERE table_schema = %(s)s""",
        "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = %(s)s",
        "constraints": """SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid)
            FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace WHERE n.nspname = %(s)s""",
        "sequences": """SELECT sequence_name, data_type, start_value, increment
            FROM information_schema.sequences WHERE sequence_schema = %(s)s""",
        "triggers": """SELECT event_object_table, trigger_name, action_statement
            FROM information_schema.triggers WHERE trigger_schema = %(s)s""",
    }
    found: dict[str, list[tuple[object, ...]]] = {}
    with connection.cursor() as cursor:
        for name, sql in queries.items():
            cursor.execute(sql, {"s": schema})
            found[name] = sorted(
                tuple(re.sub(rf'"?\b{schema}\b"?\.', "", value) if isinstance(value, str) else value
                      for value in row)
                for row in cursor.fetchall()
            )  # fmt: skip
        quoted = connection.ops.quote_name(schema)
        cursor.execute(f"SELECT app, name FROM {quoted}.django_migrations")  # noqa: S608 (a test schema)
        found["migrations"] = sorted(cursor.fetchall())
        cursor.execute(f"SELECT app_label, model FROM {quoted}.django_content_type")  # noqa: S608
        found["content types"] = sorted(cursor.fetchall())
    return found


def test_a_schema_from_the_template_is_the_schema_migrating_makes(world: World, db: None) -> None:
    replayed = tenant_create(slug="tpl-replayed", name="Replayed", admin_username="rita")
    with override_settings(KLIQUE_SCHEMA_TEMPLATE=False):
        migrated = tenant_create(slug="tpl-migrated", name="Migrated", admin_username="rita")
    key, count = template.fingerprint()
    assert SchemaTemplate.objects.filter(fingerprint=key, migrations=count).exists()

    ours, theirs = catalog("tpl_replayed"), catalog("tpl_migrated")
    assert ours == theirs
    assert len(ours["columns"]) > 300
    assert len(ours["indexes"]) > 100
    assert len(ours["constraints"]) > 100
    assert len(ours["migrations"]) == count  # every migration on disk, recorded as applied

    # The new tenant works at once, and its first admin is its only person.
    for created in (replayed, migrated):
        client = APIClient(HTTP_HOST=created.address, HTTP_AUTHORIZATION=f"Bearer {created.admin_token}")
        me = client.get("/api/v1/me/")
        assert me.status_code == 200, me.content
        assert me.json()["username"] == "rita"
        assert [user["username"] for user in client.get("/api/v1/users/").json()["results"]] == ["rita"]
        made = client.post("/api/v1/projects/", {"name": "first"}, format="json")
        assert made.status_code == 201, made.content


def test_the_template_follows_the_migrations_on_disk(
    world: World, db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new or changed migration changes the fingerprint: the next tenant builds a template for it, and a
    template of another set of migrations is never replayed."""
    _, count = template.fingerprint()
    SchemaTemplate.objects.create(fingerprint="0" * 64, sql="CREATE SCHEMA broken;", migrations=1)
    monkeypatch.setattr(template, "_built", {})
    monkeypatch.setattr(template, "fingerprint", lambda: ("f" * 64, count))

    created = tenant_create(slug="tpl-next", name="Next", admin_username="nina")

    assert SchemaTemplate.objects.filter(fingerprint="f" * 64).exists()
    assert catalog("tpl_next")["migrations"] == catalog(str(world.tenant_a.schema_name))["migrations"]
    assert created.tenant.schema_name == "tpl_next"
    # Only a few templates are kept.
    for number in range(5):
        monkeypatch.setattr(template, "fingerprint", lambda number=number: (f"{number + 1:064d}", count))
        assert template.ensure()
    # (the decoy is this test's own, uncommitted: builds commit apart, and prune what they see)
    assert SchemaTemplate.objects.exclude(fingerprint="0" * 64).count() == 5


@pytest.mark.parametrize("missing", ["no pg_dump", "pg_dump fails", "switched off"])
def test_without_a_template_tenants_are_migrated(
    world: World,
    db: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    missing: str,
) -> None:
    _, count = template.fingerprint()
    monkeypatch.setattr(template, "_built", {})
    monkeypatch.setattr(template, "_warned", set())
    monkeypatch.setattr(template, "_failed_at", {})
    monkeypatch.setattr(template, "fingerprint", lambda: ("e" * 64, count))
    if missing == "no pg_dump":
        monkeypatch.setattr(template, "pg_dumps", list)
    elif missing == "pg_dump fails":  # (as one older than the server does: each is tried, then migrating)
        monkeypatch.setattr(template, "pg_dumps", lambda: ["/bin/false", "/bin/false"])
    else:
        monkeypatch.setattr("django.conf.settings.KLIQUE_SCHEMA_TEMPLATE", False)

    with caplog.at_level(logging.WARNING, logger="tenants.template"):
        created = tenant_create(slug="tpl-plain", name="Plain", admin_username="otto")

    assert not SchemaTemplate.objects.filter(fingerprint="e" * 64).exists()
    assert len(catalog("tpl_plain")["migrations"]) == count
    with connection.cursor() as cursor:  # the template's own schema never outlives a build
        cursor.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [template.TEMPLATE_SCHEMA])
        assert cursor.fetchone() is None
    warned = [record.getMessage() for record in caplog.records]
    if missing == "switched off":
        assert warned == []
    else:
        assert warned == ["new tenant schemas are migrated one by one: the schema template cannot be built"]
        reason = caplog.records[0].reason  # type: ignore[attr-defined]
        assert ("not installed" if missing == "no pg_dump" else "pg_dump failed") in reason
    client = APIClient(HTTP_HOST=created.address, HTTP_AUTHORIZATION=f"Bearer {created.admin_token}")
    assert client.get("/api/v1/me/").json()["username"] == "otto"

    # A failed build is not tried again at each creation (each would migrate the template first), but
    # after a while.
    built: list[str] = []

    def build(key: str, count: int) -> str:
        built.append(key)
        raise template.TemplateUnavailable("still none")

    monkeypatch.setattr(template, "build", build)
    assert template.schema_sql("tpl_other") is None
    assert built == []
    if missing != "switched off":
        monkeypatch.setattr(template, "RETRY_SECONDS", 0.0)
        assert template.schema_sql("tpl_other") is None
        assert built == ["e" * 64]


def test_the_embedded_pg_dump_comes_before_the_host_s() -> None:
    """The embedded PostgreSQL's pg_dump (the newer, here) is tried first; the host's after it."""
    programs = template.pg_dumps()
    assert Path(programs[0]).parts[-4:] == ("pgserver", "pginstall", "bin", "pg_dump")
    host = shutil.which("pg_dump")
    assert programs[1:] == ([host] if host else [])


def test_creation_from_the_template_is_all_or_nothing(
    world: World, db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after the schema is replayed leaves no row, schema or domain; a name taken is refused
    before any schema is touched."""

    def broken_token_create(**kwargs: object) -> None:
        raise RuntimeError("token store unavailable")

    with monkeypatch.context() as patched:
        patched.setattr("apps.accounts.services.token_create", broken_token_create)
        with pytest.raises(RuntimeError, match="token store unavailable"):
            tenant_create(slug="tpl-broken", name="Broken", admin_username="bob")
    assert not Tenant.objects.filter(slug="tpl-broken").exists()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'tpl_broken'")
        assert cursor.fetchone() is None
    with pytest.raises(Conflict):
        tenant_create(slug=str(world.tenant_a.slug), name="again", admin_username="bob")


@pytest.mark.parametrize(
    "name", ["", "Upper", "1digit", "has-hyphen", 'quo"te', "semi;colon", "a" * 64, "space d", "public.x"]
)
def test_renaming_takes_only_tenant_schema_names(name: str) -> None:
    with pytest.raises(ValueError, match="not a tenant schema name"):
        template.rename("CREATE SCHEMA _klique_template;", name)


def test_renaming_reaches_every_qualified_name_and_nothing_else() -> None:
    dumped = "\n".join(
        [
            "-- PostgreSQL database dump",
            "\\restrict abc",
            "SET statement_timeout = 0;",
            "SELECT pg_catalog.set_config('search_path', '', false);",
            "CREATE SCHEMA _klique_template;",
            "CREATE TABLE _klique_template.t (",
            "    id bigint DEFAULT nextval('_klique_template.t_id_seq'::regclass),",
            "    note text);",
            "ALTER TABLE ONLY _klique_template.t ADD CONSTRAINT t_fk FOREIGN KEY (id) REFERENCES "
            "_klique_template.u(id);",
            "INSERT INTO _klique_template.t VALUES (1, 'my_klique_template.is not ours');",
            "SELECT pg_catalog.setval('_klique_template.t_id_seq', 1, true);",
            "",
        ]
    )
    sql = template.replayable(dumped)
    for left_out in ("SET ", "set_config", "\\restrict", "--"):
        assert left_out not in sql
    renamed = template.rename(sql, "acme_2")
    assert renamed.count('"acme_2"') == 7
    assert "my_klique_template.is not ours" in renamed
    assert 'CREATE SCHEMA "acme_2";' in renamed


@pytest.mark.parametrize(
    "dumped",
    [
        "CREATE TABLE x.t (id int);",  # no schema of its own
        "CREATE SCHEMA _klique_template;\nCOMMENT ON SCHEMA \"_klique_template\" IS 'x';",  # quoted name
        "CREATE SCHEMA _klique_template;\nGRANT USAGE ON SCHEMA _klique_template TO someone;",
        'CREATE SCHEMA _klique_template;\nALTER TABLE ONLY "_klique_template".t ADD COLUMN x int;',
    ],
)
def test_a_dump_renaming_would_not_reach_is_refused(dumped: str) -> None:
    with pytest.raises(template.TemplateUnavailable):
        template.replayable(dumped)
