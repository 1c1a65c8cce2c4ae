"""`klique migrate [--processes N]`: the public schema, then every tenant schema with a migration to apply,
in parallel; resumable (tenants/migrate.py)."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from tenants import template
from tenants.migrate import default_processes, migrate_all


class Command(BaseCommand):
    help = "Migrate the public schema, then every tenant schema that lacks a migration, N at a time."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--processes",
            type=int,
            default=None,
            help=f"schemas migrated at once (default KLIQUE_MIGRATE_PROCESSES or {default_processes()})",
        )

    def handle(self, *args: Any, processes: int | None, **options: Any) -> None:
        if processes is not None and processes < 1:
            raise CommandError("--processes is how many schemas are migrated at once: 1 or more.")
        summary = migrate_all(processes=processes, progress=self.stdout.write)
        migrated = len(summary.migrated) - len(summary.failed)
        self.stdout.write(
            f"{migrated} tenant schemas migrated, {summary.up_to_date} already up to date, "
            f"{len(summary.failed)} failed"
        )
        # New tenants' schemas come from the template of these migrations: build it now, not at the first one.
        self.stdout.write(
            "schema template for new tenants: "
            + ("ready" if template.ensure() else "not available, new tenants are migrated (the log says why)")
        )
        if summary.failed:
            named = "\n".join(f"  {failed.schema}: {failed.error}" for failed in summary.failed)
            raise CommandError(
                f"These schemas were not migrated (the others are done):\n{named}\n"
                "Fix what their errors say, then run `klique migrate` again: it migrates only the schemas "
                "still lacking a migration."
            )
