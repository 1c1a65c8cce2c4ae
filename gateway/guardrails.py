"""Guardrails: what a prompt and a reply may contain, which models a role may call, how long a reply may be.

Checked before the call on every message, and after it on the reply (`check_output`). Blocked terms
refuse; personal data (e-mail addresses, phone numbers, card numbers that pass the Luhn check, US social
security numbers, IBANs) is redacted or refused as the tenant chose. A streamed reply is checked as it
goes: `StreamGuard` holds back the last `HOLD_BACK` characters so that a term or a number split across
chunks is still caught (anything longer than that can slip through a stream; a whole reply is checked
whole). Pure Python, no Django.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.config import Guardrails

HOLD_BACK = 64

_PATTERNS = {
    "email": re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b"),
    "credit_card": re.compile(r"\b(?:\d[ -]?){12,18}\d\b"),
    "ssn": re.compile(r"\b\d{3}-\d{2}-\d{4}\b"),
    "iban": re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b"),
    # Not inside a longer run of digit groups (a card number that failed its check is not a phone number).
    "phone": re.compile(
        r"(?<![\w+])(?<!\d[ .-])\+?\d{1,3}[ .-]?\(?\d{2,4}\)?[ .-]?\d{3,4}[ .-]?\d{3,4}\b(?![ .-]?\d)"
    ),
}
# Card numbers before phone numbers: a 16-digit card also looks like a phone number.
_ORDER = ("email", "credit_card", "ssn", "iban", "phone")


class GuardrailRefused(Exception):
    """A request or reply the tenant's guardrails refuse; `code` names the rule for the client."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _luhn(digits: str) -> bool:
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = int(char)
        if index % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


@dataclass(frozen=True)
class Checker:
    rules: Guardrails

    def _blocked(self) -> re.Pattern[str] | None:
        if not self.rules.blocked_terms:
            return None
        return re.compile(
            "|".join(rf"(?<!\w){re.escape(term)}(?!\w)" for term in self.rules.blocked_terms), re.IGNORECASE
        )

    def _pii(self, text: str) -> list[tuple[str, re.Match[str]]]:
        found = []
        taken: list[tuple[int, int]] = []
        for kind in _ORDER:
            if kind not in self.rules.pii_kinds:
                continue
            for match in _PATTERNS[kind].finditer(text):
                if kind == "credit_card" and not _luhn(re.sub(r"\D", "", match[0])):
                    continue
                if any(start < match.end() and match.start() < end for start, end in taken):
                    continue
                taken.append(match.span())
                found.append((kind, match))
        return found

    def text(self, text: str, *, where: str) -> str:
        """`text` as it may pass: unchanged, redacted, or GuardrailRefused saying what was wrong."""
        blocked = self._blocked()
        if blocked is not None and (match := blocked.search(text)):
            raise GuardrailRefused(
                f"The {where} contains the blocked term {match[0]!r}; this tenant does not allow it. "
                "Rephrase without it, or ask a tenant admin about the gateway's guardrails.",
                "blocked_term",
            )
        if self.rules.pii_action == "off":
            return text
        found = self._pii(text)
        if not found:
            return text
        if self.rules.pii_action == "refuse":
            kinds = sorted({kind.replace("_", " ") for kind, _ in found})
            raise GuardrailRefused(
                f"The {where} contains personal data ({', '.join(kinds)}); this tenant refuses it. "
                "Remove it and send again.",
                "pii_refused",
            )
        for kind, match in sorted(found, key=lambda item: item[1].start(), reverse=True):
            text = f"{text[: match.start()]}[REDACTED:{kind.upper()}]{text[match.end() :]}"
        return text

    def model_allowed(self, model: str, role: str) -> None:
        allowed = self.rules.models_by_role
        if allowed is None or role not in allowed:
            return
        if "*" not in allowed[role] and model not in allowed[role]:
            names = ", ".join(allowed[role]) or "none"
            raise GuardrailRefused(
                f"The {role} role may not call {model!r} here; it may call: {names}. "
                "Ask a tenant admin for another role or model.",
                "model_not_allowed",
            )

    def max_tokens(self, requested: int | None, model_cap: int) -> int:
        """The reply's length limit: what was asked for, within the model's and the tenant's caps."""
        cap = self.rules.max_tokens_cap
        if requested is not None and cap is not None and requested > cap:
            raise GuardrailRefused(
                f"max_tokens {requested} is above this tenant's cap of {cap}; ask for {cap} or fewer.",
                "max_tokens_cap",
            )
        limit = min(model_cap, cap) if cap is not None else model_cap
        return min(requested, limit) if requested is not None else limit

    def messages(self, messages: Iterable[dict[str, object]]) -> list[dict[str, object]]:
        """Chat messages as they may be sent upstream (text content checked, parts included)."""
        checked = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                checked.append({**message, "content": self.text(content, where="prompt")})
            elif isinstance(content, list):
                checked.append({**message, "content": [self._part(part) for part in content]})
            else:
                checked.append(message)
        return checked

    def _part(self, part: object) -> object:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            return {**part, "text": self.text(part["text"], where="prompt")}
        return part


class StreamGuard:
    """Checks a streamed reply chunk by chunk, holding back the tail that a later chunk could complete."""

    def __init__(self, checker: Checker) -> None:
        self.checker = checker
        self.pending = ""

    def feed(self, text: str) -> str:
        self.pending = self.checker.text(self.pending + text, where="reply")
        if len(self.pending) <= HOLD_BACK:
            return ""
        ready, self.pending = self.pending[:-HOLD_BACK], self.pending[-HOLD_BACK:]
        return ready

    def finish(self) -> str:
        rest, self.pending = self.pending, ""
        return rest
