"""The API's JSON parser: DRF's, refusing NUL characters anywhere in the document (see
apps.core.middleware.RefuseNulMiddleware for why)."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser as DrfJSONParser

from apps.core.middleware import NUL_REFUSED, has_nul


class JSONParser(DrfJSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        document = super().parse(stream, media_type, parser_context)
        if has_nul(document):
            raise ParseError(NUL_REFUSED)
        return document
