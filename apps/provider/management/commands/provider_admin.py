"""`klique provider-admin USERNAME`: make (or find) a provider admin and print a fresh token for them."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand
from django_tenants.utils import get_public_schema_name, schema_context

from apps.accounts.models import Role, User
from apps.accounts.services import token_create
from apps.provider.services import public_tenant_ensure


class Command(BaseCommand):
    help = "Create a provider admin in the public schema, or issue a new token to an existing one."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--email", default="")

    def handle(self, *args: Any, username: str, email: str, **options: Any) -> None:
        public = public_tenant_ensure()
        with schema_context(get_public_schema_name()):
            admin, created = User.objects.get_or_create(
                username=username, defaults={"email": email, "role": Role.ADMIN}
            )
            if created:
                admin.set_unusable_password()
                admin.save()
            issued = token_create(tenant=public, user=admin, name="provider admin token")
        self.stdout.write(f"{'Created' if created else 'Found'} provider admin {username}")
        self.stdout.write(f"Token (shown once): {issued.secret}")
