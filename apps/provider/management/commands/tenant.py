"""`klique tenant create|list|suspend|resume|delete`: the provider's CLI over tenants.services."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from apps.core.errors import KliqueError
from apps.provider import services
from apps.provider.serializers import TenantOut
from tenants import selectors


class Command(BaseCommand):
    help = "Create, list, suspend, resume and delete tenants."

    def add_arguments(self, parser: ArgumentParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        create = actions.add_parser("create", help="create a tenant, its schema, domain and first admin")
        create.add_argument("slug")
        create.add_argument("--name", default="")
        create.add_argument("--admin", required=True, help="username of the first admin")
        create.add_argument("--admin-email", default="")
        create.add_argument("--gpu-share", type=int, default=None, help="cap in whole GPUs (default: none)")
        actions.add_parser("list", help="list tenants")
        suspend = actions.add_parser("suspend", help="refuse the tenant's requests, with a reason")
        suspend.add_argument("slug")
        suspend.add_argument("--reason", required=True)
        resume = actions.add_parser("resume", help="lift a suspension")
        resume.add_argument("slug")
        delete = actions.add_parser("delete", help="drop a tenant and all of its data")
        delete.add_argument("slug")
        delete.add_argument("--yes", action="store_true", help="confirm: this cannot be undone")

    def handle(self, *args: Any, **options: Any) -> None:
        services.public_tenant_ensure()
        try:
            getattr(self, f"do_{options['action']}")(**options)
        except KliqueError as error:
            raise CommandError(error.message) from None

    def tenant(self, slug: str) -> Any:
        tenant = selectors.tenant_get(slug=slug)
        if tenant is None:
            raise CommandError(f"No tenant named {slug!r}; `klique tenant list` shows them.")
        return tenant

    def do_create(
        self, *, slug: str, name: str, admin: str, admin_email: str, gpu_share: int | None, **_: Any
    ) -> None:
        created = services.tenant_create(
            slug=slug, name=name, admin_username=admin, admin_email=admin_email, gpu_share=gpu_share
        )
        self.stdout.write(f"Created tenant {created.tenant.slug} at {created.address}")
        self.stdout.write(f"First admin: {created.admin_username}")
        self.stdout.write(f"Admin token (shown once): {created.admin_token}")

    def do_list(self, **_: Any) -> None:
        for tenant in selectors.tenant_list():
            self.stdout.write(json.dumps(TenantOut(tenant).data, default=str))

    def do_suspend(self, *, slug: str, reason: str, **_: Any) -> None:
        services.tenant_suspend(tenant=self.tenant(slug), reason=reason)
        self.stdout.write(f"Suspended {slug}: {reason}")

    def do_resume(self, *, slug: str, **_: Any) -> None:
        services.tenant_resume(tenant=self.tenant(slug))
        self.stdout.write(f"Resumed {slug}")

    def do_delete(self, *, slug: str, yes: bool, **_: Any) -> None:
        if not yes:
            raise CommandError(f"Deleting {slug} drops all of its data; pass --yes to confirm.")
        services.tenant_delete(tenant=self.tenant(slug))
        self.stdout.write(f"Deleted {slug}")
