"""Envelope encryption for the vault.

Each tenant has a data key (AES-256-GCM) that encrypts its secrets; the data key is stored wrapped by
the master key, which comes from the environment (KLIQUE_MASTER_KEYS: Fernet keys, comma-separated,
the first one current). Rotating the master key puts a new key first and runs `klique manage
vault_rotate`, which re-wraps every data key: the old keys stay listed until it has run, so every
secret stays readable throughout. Where no master key is configured (a laptop, the tests), one is made
once in the data folder, readable by its owner only.

A secret's ciphertext is bound to its tenant and row (AES-GCM's associated data), so it cannot be moved
to another secret or tenant and still decrypt.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings

NONCE_BYTES = 12


class VaultKeyError(Exception):
    """The master key is missing, malformed or not the one the data was wrapped with; says what to do."""


def _local_key() -> str:
    path = Path(settings.KLIQUE_DATA_DIR) / "master.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it first
        else:
            with os.fdopen(descriptor, "w") as handle:
                handle.write(Fernet.generate_key().decode())
    return path.read_text().strip()


def master_keys() -> list[str]:
    return list(settings.KLIQUE_MASTER_KEYS) or [_local_key()]


def master() -> MultiFernet:
    try:
        return MultiFernet([Fernet(key.encode()) for key in master_keys()])
    except ValueError:
        raise VaultKeyError(
            "KLIQUE_MASTER_KEYS holds a value that is not a Fernet key (32 url-safe base64 bytes); "
            "make one with `klique manage vault_key`."
        ) from None


def key_id(key: str) -> str:
    """A short, public name for a master key: the start of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def current_key_id() -> str:
    return key_id(master_keys()[0])


def new_data_key() -> tuple[bytes, bytes]:
    """A fresh data key and its wrapped form."""
    key = AESGCM.generate_key(bit_length=256)
    return key, master().encrypt(key)


def unwrap(wrapped: bytes) -> bytes:
    try:
        return master().decrypt(bytes(wrapped))
    except InvalidToken:
        raise VaultKeyError(
            "The vault's data key was wrapped by a master key that KLIQUE_MASTER_KEYS no longer lists; "
            "put the previous key back after the current one and run `klique manage vault_rotate`."
        ) from None


def rewrap(wrapped: bytes) -> bytes:
    try:
        return master().rotate(bytes(wrapped))
    except InvalidToken:
        raise VaultKeyError("A data key cannot be read with any key of KLIQUE_MASTER_KEYS.") from None


def seal(data_key: bytes, plaintext: str, bound_to: str) -> bytes:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + AESGCM(data_key).encrypt(nonce, plaintext.encode(), bound_to.encode())


def open_sealed(data_key: bytes, sealed: bytes, bound_to: str) -> str:
    sealed = bytes(sealed)
    return AESGCM(data_key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], bound_to.encode()).decode()
