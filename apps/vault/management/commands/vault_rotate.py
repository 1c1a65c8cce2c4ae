"""Re-wrap every tenant's data key with the current master key (the first of KLIQUE_MASTER_KEYS)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand
from django_tenants.utils import get_public_schema_name, schema_context

from apps.vault.crypto import current_key_id
from apps.vault.services import vault_rotate
from tenants.models import Tenant


class Command(BaseCommand):
    help = __doc__

    def handle(self, *args: Any, **options: Any) -> None:
        changed = 0
        tenants = Tenant.objects.exclude(schema_name=get_public_schema_name())
        for tenant in tenants:
            with schema_context(tenant.schema_name):
                changed += vault_rotate()
        self.stdout.write(
            f"{changed} of {tenants.count()} tenants' data keys re-wrapped with master key "
            f"{current_key_id()}; every key listed in KLIQUE_MASTER_KEYS after the first may now be removed."
        )
