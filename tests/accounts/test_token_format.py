"""Properties of the token format, checked over many generated inputs."""

from __future__ import annotations

import string

from hypothesis import given
from hypothesis import strategies as st

from apps.accounts.tokens import hash_token, new_token, parse_prefix


def test_every_new_token_parses_to_its_own_prefix() -> None:
    tokens = [new_token() for _ in range(500)]
    for token, prefix in tokens:
        assert parse_prefix(token) == prefix
        assert len(hash_token(token)) == 64
    assert len({prefix for _, prefix in tokens}) == len(tokens)


@given(st.text(alphabet=string.printable, max_size=80))
def test_arbitrary_text_is_never_mistaken_for_a_token(text: str) -> None:
    prefix = parse_prefix(text)
    if prefix is not None:  # only a string of exactly the token's shape may parse
        assert text.startswith(f"klq_{prefix}_")
        assert len(text) == 4 + 8 + 1 + 32


@given(st.text(min_size=1, max_size=5))
def test_any_change_to_a_token_changes_its_hash(suffix: str) -> None:
    token, _ = new_token()
    assert hash_token(token) != hash_token(token + suffix)
