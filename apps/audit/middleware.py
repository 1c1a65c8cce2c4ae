"""Record what must be audited even when the request's own transaction is rolled back: a rejected token,
or a delegated token used beyond its scope. The refusal is noted on the request (`record_after`) and
written here, once the view and its transaction are over."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse

from apps.audit.services import record

ATTRIBUTE = "klique_audit_after"


def record_after(
    request: HttpRequest, *, actor: str, action: str, reason: str, on_behalf_of: str = ""
) -> None:
    """Have RefusedUseAudit record this refusal of `request` after its transaction."""
    target = f"{request.method} {request.path}"
    setattr(request, ATTRIBUTE, {"actor": actor, "action": action, "target": target,
                                 "on_behalf_of": on_behalf_of, "reason": reason})  # fmt: skip


class RefusedUseAudit:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        refused: dict[str, Any] | None = getattr(request, ATTRIBUTE, None)
        if refused is not None:
            record(**refused)  # the reason lands in the event's detail
        return response
