"""A real deployment: every secret comes from the environment and nothing insecure is defaulted."""

from __future__ import annotations

from config import env
from config.settings.base import *

SECRET_KEY = env.required_text(
    "SECRET_KEY", "Generate one with `python -c 'import secrets; print(secrets.token_urlsafe(50))'`."
)
KLIQUE_MASTER_KEYS = env.words("KLIQUE_MASTER_KEYS") or env.required_text(
    "KLIQUE_MASTER_KEYS", "The vault needs a master key: make one with `klique manage vault_key`."
).split(",")
DEBUG = False
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
