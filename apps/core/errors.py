"""Errors a user can meet, raised by services; apps.core.api_errors turns them into responses."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


class KliqueError(Exception):
    """Raised by services for a request that cannot be carried out; the message is shown to the user."""

    status_code = HTTPStatus.BAD_REQUEST

    def __init__(self, message: str, *, field: str | None = None, errors: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.errors = errors  # field -> messages, nested as the input is (a document's), when known


class InvalidInput(KliqueError):
    status_code = HTTPStatus.BAD_REQUEST


class Forbidden(KliqueError):
    """The caller may not do this (their role, or the object is someone else's); the message says who may."""

    status_code = HTTPStatus.FORBIDDEN


class NotFound(KliqueError):
    status_code = HTTPStatus.NOT_FOUND


class Conflict(KliqueError):
    status_code = HTTPStatus.CONFLICT


def error_lines(errors: Any, path: str = "") -> list[str]:
    """Nested field errors (a serializer's) as "path: message" lines, one per message: fields by name,
    items of a list by position ("pools[1].capacity_gpus: A valid integer is required.")."""

    def step(key: object) -> str:
        if isinstance(key, int):
            return f"{path}[{key}]"
        if key == "non_field_errors":
            return path
        return f"{path}.{key}" if path else str(key)

    if isinstance(errors, dict):
        return [line for key, value in errors.items() for line in error_lines(value, step(key))]
    if isinstance(errors, list) and any(isinstance(item, dict | list) for item in errors):
        return [line for index, item in enumerate(errors) for line in error_lines(item, step(index))]
    if isinstance(errors, list):
        return [line for item in errors for line in error_lines(item, path)]
    return [f"{path}: {errors}" if path else str(errors)]
