"""Print a new master key for KLIQUE_MASTER_KEYS (put it first, keep the old ones after it, then run
`klique manage vault_rotate`)."""

from __future__ import annotations

from typing import Any

from cryptography.fernet import Fernet
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = __doc__.splitlines()[0]

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(Fernet.generate_key().decode())
