"""Each test here starts with no host's schema remembered (tenants.selectors), so a test of the lookup
looks up, whatever ran before it in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tenants import selectors


@pytest.fixture(autouse=True)
def no_host_remembered() -> Iterator[None]:
    selectors._schema_at_host.clear()
    yield
    selectors._schema_at_host.clear()
