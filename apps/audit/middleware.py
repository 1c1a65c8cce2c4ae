"""Record what must be audited even when the request's own transaction is rolled back: a delegated
token refused for going beyond its scope (see apps.audit.mixins)."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from apps.audit.services import record


class RefusedUseAudit:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        refused = getattr(request, "audit_refused", None)
        if refused is not None:
            record(
                actor=refused["actor"],
                on_behalf_of=refused["on_behalf_of"],
                action=refused["action"],
                target=refused["target"],
                reason=refused["detail"],
            )
        return response
