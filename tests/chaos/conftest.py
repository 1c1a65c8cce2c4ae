"""The chaos experiments run on the end-to-end tests' real processes and their fresh database."""

from tests.e2e.conftest import fresh_database, redis_url

__all__ = ["fresh_database", "redis_url"]
