from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import pytest_django.fixtures
from rest_framework.test import APIClient

from tests.world import HOST_A, HOST_B, HOST_PROVIDER, World, build_world

HOSTS = {"a": HOST_A, "b": HOST_B, "provider": HOST_PROVIDER}

pytest_plugins = ["tests.slurm", "tests.containers"]  # a real single-node Slurm (tests/hpc), a real podman


def _databases_for_setup(items: Sequence[pytest.Item]) -> tuple[set[str], set[str]]:
    """pytest-django sets up only the databases that the collected tests ask for through `db`,
    `transactional_db` or a `django_db` mark. Tests that read committed rows from threads (tests/fleet, the
    websocket consumers) ask for none of them: they use `world` and `django_db_blocker` instead, and run
    alone they found no test database. The default one is always set up here."""
    aliases, serialized = _pytest_django_databases(items)
    return {*aliases, "default"}, serialized


_pytest_django_databases = pytest_django.fixtures._get_databases_for_setup
pytest_django.fixtures._get_databases_for_setup = _databases_for_setup


@pytest.fixture(scope="session")
def world(django_db_setup: None, django_db_blocker: pytest.FixtureRequest) -> World:
    """Two tenants, their people and objects, committed once for the whole session."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        return build_world()


@pytest.fixture
def api(world: World, db: None) -> Callable[..., APIClient]:
    """`api("alice")` is a client for alice at her tenant's address; `api("alice", host="b")` elsewhere."""
    home = {"root": "provider", "paula": "provider", "charlie": "b"}

    def client(persona: str | None = None, *, host: str | None = None) -> APIClient:
        where = host or (home.get(persona, "a") if persona else "a")
        api_client = APIClient(HTTP_HOST=HOSTS[where])
        if persona is not None:
            api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {world.tokens[persona]}")
        return api_client

    return client
