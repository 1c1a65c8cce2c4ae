"""DRF's content negotiation, with the answer for the common Accept headers given at once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request


class ContentNegotiation(DefaultContentNegotiation):
    """DRF's negotiation (REST_FRAMEWORK's DEFAULT_CONTENT_NEGOTIATION_CLASS), unchanged in what it
    answers. Nearly every API call names no format and accepts anything (`*/*`, what curl, httpx, requests
    and the official clients send) or exactly the first renderer's media type. DRF's answer to either is
    the first renderer and its media type (for `*/*`, where that media type has no parameters), given here
    without parsing the header into media types and ranking them (bench/request_path.py). Every other
    request is DRF's to answer, as before."""

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        if (
            isinstance(renderers, list | tuple)
            and renderers
            and not (format_suffix or request.query_params.get(self.settings.URL_FORMAT_OVERRIDE))
        ):
            first: Any = renderers[0]
            accept = request.META.get("HTTP_ACCEPT", "*/*").strip()
            # (DRF matches `*/*` to a media type without parameters only.)
            if accept == first.media_type or (accept == "*/*" and ";" not in first.media_type):
                return first, first.media_type
        return super().select_renderer(request, renderers, format_suffix)  # type: ignore[no-any-return]
