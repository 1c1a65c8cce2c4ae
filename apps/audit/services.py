"""Record what administrators do and every read of a secret. Callers pass words, never values."""

from __future__ import annotations

from typing import Any

from apps.audit.models import AuditEvent
from apps.core.logging import request_id_var


def record(*, actor: str, action: str, target: str, on_behalf_of: str = "", **detail: Any) -> AuditEvent:
    return AuditEvent.objects.create(
        actor=actor,
        on_behalf_of=on_behalf_of,
        action=action,
        target=target,
        detail=detail,
        request_id=request_id_var.get() or "",
    )
