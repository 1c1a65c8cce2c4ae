"""The test suite: real PostgreSQL and Redis, on 127.0.0.1 when they listen there, else embedded ones."""

from __future__ import annotations

from pathlib import Path

from klique.embedded import ensure_services

# Before the base layer reads DATABASE_URL and REDIS_URL: fill them in from what this machine offers.
TEST_SERVICES = ensure_services(
    Path(__file__).resolve().parent.parent.parent / ".klique" / "test", prefer_local=True
)

from config import env  # noqa: E402
from config.settings.base import *  # noqa: E402 -- must follow ensure_services, which sets the environment

KLIQUE_BASE_DOMAIN = "klique.test"
ALLOWED_HOSTS = [KLIQUE_BASE_DOMAIN, f".{KLIQUE_BASE_DOMAIN}"]
WHITENOISE_USE_FINDERS = True
# The suite's model servers and identity provider listen on loopback; tests of the guard itself set this
# to nothing (tests/security/test_outbound.py).
KLIQUE_OUTBOUND_ALLOW = env.words("KLIQUE_OUTBOUND_ALLOW", ("127.0.0.0/8", "::1/128"))
STATIC_ROOT = None  # served from the apps by WhiteNoise; collectstatic is for production
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # speed; no test relies on hash cost
CELERY_BEAT_SCHEDULE = {}
# Threads that serve websockets in tests must let go of their connections, or the test database
# cannot be dropped at the end of the run.
DATABASES["default"]["CONN_MAX_AGE"] = 0
MEDIA_ROOT = BASE_DIR / ".klique" / "test" / "files"
