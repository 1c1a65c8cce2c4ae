"""The API's JSON parser: DRF's, refusing NUL characters anywhere in the document (see
apps.core.middleware.RefuseNulMiddleware for why)."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import FormParser as DrfFormParser
from rest_framework.parsers import JSONParser as DrfJSONParser
from rest_framework.parsers import MultiPartParser as DrfMultiPartParser

from apps.core.middleware import NUL_REFUSED, has_nul


class JSONParser(DrfJSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        document = super().parse(stream, media_type, parser_context)
        if has_nul(document):
            raise ParseError(NUL_REFUSED)
        return document


def _refuse_unstorable(parsed: Any) -> Any:
    data = getattr(parsed, "data", parsed)  # multipart answers DataAndFiles
    lists = dict(data.lists()) if hasattr(data, "lists") else data
    if has_nul(lists):
        raise ParseError(NUL_REFUSED)
    return parsed


class FormParser(DrfFormParser):
    """DRF's, refusing NULs too: a PUT or PATCH form is parsed here, not by Django's request.POST."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        return _refuse_unstorable(super().parse(stream, media_type, parser_context))


class MultiPartParser(DrfMultiPartParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        return _refuse_unstorable(super().parse(stream, media_type, parser_context))
