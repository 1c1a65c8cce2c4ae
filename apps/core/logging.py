"""Log formatting with the request id and tenant of the work in progress on every line.

The request middleware, the websocket consumers and the Celery tenant-task wrapper set the context;
formatters read it, so no call site has to pass it along.
"""

from __future__ import annotations

import contextvars
import json
import logging
from datetime import UTC, datetime

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
tenant_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)

# Attributes every LogRecord has; anything else was passed through `extra=` and belongs in the line.
_STANDARD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": request_id_var.get(),
            "tenant": tenant_var.get(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRIBUTES and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        context = " ".join(
            f"{name}={value}"
            for name, value in (("tenant", tenant_var.get()), ("request", request_id_var.get()))
            if value
        )
        at = datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")
        text = f"{at} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if context:
            text = f"{text} [{context}]"
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        return text
