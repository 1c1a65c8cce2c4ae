"""Database work from async code: in a worker thread of its own, with its connection closed after it, so
a connection broken by a database restart is never kept."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

P = ParamSpec("P")
R = TypeVar("R")


def in_db_thread(function: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """`function` as an awaitable that runs in a thread of its own, its database connection closed after."""

    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        finally:
            close_old_connections()

    return sync_to_async(run, thread_sensitive=False)
