"""Errors a user can meet, raised by services; apps.core.api_errors turns them into responses."""

from __future__ import annotations

from http import HTTPStatus


class KliqueError(Exception):
    """Raised by services for a request that cannot be carried out; the message is shown to the user."""

    status_code = HTTPStatus.BAD_REQUEST

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidInput(KliqueError):
    status_code = HTTPStatus.BAD_REQUEST


class Forbidden(KliqueError):
    """The caller may not do this (their role, or the object is someone else's); the message says who may."""

    status_code = HTTPStatus.FORBIDDEN


class NotFound(KliqueError):
    status_code = HTTPStatus.NOT_FOUND


class Conflict(KliqueError):
    status_code = HTTPStatus.CONFLICT
