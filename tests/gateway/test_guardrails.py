"""Guardrails without I/O: blocked terms, personal data, roles, caps, and replies checked as they stream."""

from __future__ import annotations

import pytest

from gateway.config import Guardrails
from gateway.guardrails import HOLD_BACK, Checker, GuardrailRefused, StreamGuard


def checker(**rules: object) -> Checker:
    return Checker(Guardrails(**rules))  # type: ignore[arg-type]


def test_blocked_terms_match_whole_words_in_any_case() -> None:
    rules = checker(blocked_terms=("nuke", "project x"))
    with pytest.raises(GuardrailRefused) as refused:
        rules.text("how to NUKE it", where="prompt")
    assert refused.value.code == "blocked_term"
    assert rules.text("nukes and nuclear", where="prompt") == "nukes and nuclear"
    with pytest.raises(GuardrailRefused, match="'Project X'"):
        rules.text("the Project X plan", where="prompt")


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("mail ann.lee+ml@corp.example.org now", "mail [REDACTED:EMAIL] now"),
        ("card 4111-1111-1111-1111.", "card [REDACTED:CREDIT_CARD]."),
        ("not a card 4111 1111 1111 1112", "not a card 4111 1111 1111 1112"),  # fails the Luhn check
        ("ssn 078-05-1120 here", "ssn [REDACTED:SSN] here"),
        ("call +49 30 1234 5678", "call [REDACTED:PHONE]"),
        ("pay DE89 3704 0044 0532 0130 00", "pay [REDACTED:IBAN]"),
        ("version 3.11 in 2026", "version 3.11 in 2026"),
    ],
)
def test_personal_data_is_redacted(text: str, redacted: str) -> None:
    assert checker(pii_action="redact").text(text, where="prompt") == redacted


def test_personal_data_is_refused_naming_its_kinds_not_its_values() -> None:
    with pytest.raises(GuardrailRefused) as refused:
        checker(pii_action="refuse").text("a@b.io and 078-05-1120", where="prompt")
    assert "(email, ssn)" in str(refused.value)
    assert "a@b.io" not in str(refused.value)


def test_only_the_kinds_chosen_are_looked_for() -> None:
    assert checker(pii_action="redact", pii_kinds=("ssn",)).text("a@b.io", where="prompt") == "a@b.io"


def test_roles_and_the_max_tokens_cap() -> None:
    rules = checker(models_by_role={"viewer": (), "member": ("chat",)}, max_tokens_cap=100)
    rules.model_allowed("chat", "member")
    rules.model_allowed("anything", "admin")  # no rule for admins: all
    with pytest.raises(GuardrailRefused, match="it may call: none"):
        rules.model_allowed("chat", "viewer")
    assert rules.max_tokens(None, 4096) == 100
    assert rules.max_tokens(50, 40) == 40
    with pytest.raises(GuardrailRefused, match="ask for 100 or fewer"):
        rules.max_tokens(101, 4096)


def test_message_parts_are_checked_too() -> None:
    parts: list[dict[str, str]] = [{"type": "text", "text": "me@x.org"}, {"type": "image_url"}]
    messages: list[dict[str, object]] = [{"role": "user", "content": parts}]
    checked = checker(pii_action="redact").messages(messages)
    assert checked[0]["content"] == [{"type": "text", "text": "[REDACTED:EMAIL]"}, {"type": "image_url"}]
    assert parts[0]["text"] == "me@x.org"  # the caller's request is left as it was


def test_a_stream_is_checked_across_chunk_boundaries() -> None:
    guard = StreamGuard(checker(pii_action="redact"))
    pieces = ["Write to ad", "min@exam", "ple.com", " for help. " + "x" * HOLD_BACK, " bye"]
    out = "".join(guard.feed(piece) for piece in pieces) + guard.finish()
    assert out == "Write to [REDACTED:EMAIL] for help. " + "x" * HOLD_BACK + " bye"
    blocked = StreamGuard(checker(blocked_terms=("secret plan",)))
    blocked.feed("the secr")
    with pytest.raises(GuardrailRefused):
        blocked.feed("et plan is")
