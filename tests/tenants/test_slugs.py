"""Slugs become schema names and host names; any slug accepted must be safe as both."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.core.errors import InvalidInput
from apps.provider.services import validate_slug

SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
HOST_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


@given(st.text(max_size=45))
def test_accepted_slugs_are_safe_schema_and_host_names(slug: str) -> None:
    try:
        validate_slug(slug)
    except InvalidInput as error:
        rejected_field = error.field
    else:
        rejected_field = None
    if rejected_field is not None:
        assert rejected_field == "slug"
        return
    assert SCHEMA_NAME.fullmatch(slug.replace("-", "_"))
    assert HOST_LABEL.fullmatch(slug)
    assert not slug.replace("-", "_").startswith("pg_")  # PostgreSQL keeps pg_ schema names for itself


@pytest.mark.parametrize("slug", ["public", "pg-catalog", "www", "admin"])
def test_names_with_a_meaning_are_reserved(slug: str) -> None:
    with pytest.raises(InvalidInput, match="reserved"):
        validate_slug(slug)
