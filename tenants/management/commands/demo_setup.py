"""`klique up --demo` calls this: a demo tenant with people, a group and a project, and fresh tokens.

Safe to run again: what exists is kept and only new tokens are issued (the old ones stay valid until
they expire), so a second `make demo` reuses the data of the first.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand
from django_tenants.utils import get_public_schema_name, schema_context

from apps.accounts.models import Group, Project, Role, User
from apps.accounts.services import group_save, project_member_set, project_save, token_create, user_create
from tenants import selectors, services

DEMO_SLUG = "demo"


class Command(BaseCommand):
    help = "Create or refresh the demo tenant and print its address and tokens as one JSON line."

    def handle(self, *args: Any, **options: Any) -> None:
        public = services.public_tenant_ensure()
        with schema_context(get_public_schema_name()):
            provider, created = User.objects.get_or_create(username="provider", defaults={"role": Role.ADMIN})
            if created:
                provider.set_unusable_password()
                provider.save()
            provider_token = token_create(tenant=public, user=provider, name="demo provider token").secret

        tenant = selectors.tenant_get(slug=DEMO_SLUG)
        if tenant is None:
            created_tenant = services.tenant_create(
                slug=DEMO_SLUG,
                name="Demo",
                admin_username="alice",
                admin_email="alice@example.com",
                gpu_share=64,
            )
            tenant, admin_token = created_tenant.tenant, created_tenant.admin_token
        else:
            with schema_context(tenant.schema_name):
                admin_token = token_create(
                    tenant=tenant, user=User.objects.get(username="alice"), name="demo admin token"
                ).secret
        with schema_context(tenant.schema_name):
            alice = User.objects.get(username="alice")
            bob = User.objects.filter(username="bob").first() or user_create(
                tenant=tenant, username="bob", email="bob@example.com", role=Role.MEMBER
            )
            if not Group.objects.filter(name="research").exists():
                group_save(
                    tenant=tenant, name="research", description="Research engineers", members=[alice, bob]
                )
            project = Project.objects.filter(name="vision").first() or project_save(
                tenant=tenant, name="vision", description="Vision models", admin=alice
            )
            project_member_set(tenant=tenant, project=project, user=bob, role=Role.MEMBER)
        self.stdout.write(
            json.dumps(
                {
                    "tenant": tenant.slug,
                    "tenant_address": selectors.tenant_address(tenant),
                    "admin": "alice",
                    "admin_token": admin_token,
                    "provider_token": provider_token,
                }
            )
        )
