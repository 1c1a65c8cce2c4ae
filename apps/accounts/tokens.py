"""The shape of an API token and how it is hashed; no database here."""

from __future__ import annotations

import hashlib
import re
import secrets
import string

TOKEN_RE = re.compile(r"klq_([a-z2-7]{8})_([A-Za-z0-9_-]{32})")
_PREFIX_ALPHABET = string.ascii_lowercase + "234567"


def new_token() -> tuple[str, str]:
    """A fresh token and its public prefix."""
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(8))
    return f"klq_{prefix}_{secrets.token_urlsafe(24)}", prefix


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_prefix(token: str) -> str | None:
    match = TOKEN_RE.fullmatch(token)
    return match[1] if match else None
