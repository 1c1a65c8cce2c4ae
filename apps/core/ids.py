"""Identifiers as callers send them."""

from __future__ import annotations

import uuid


def as_uuid(reference: object) -> uuid.UUID | None:
    """The UUID `reference` spells, or None when it is a name or malformed."""
    try:
        return uuid.UUID(str(reference))
    except ValueError:
        return None
