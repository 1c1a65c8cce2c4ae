"""Rows read on every request, by SQL compiled once: the ORM compiles a query each time it runs (over a
millisecond for a join), which on the request path costs more than PostgreSQL's answer. Each reader
selects every concrete column of its models and builds them with `Model.from_db`, as the ORM does, so
what callers get is the same objects. Only for models whose fields need no conversion from the database
(plain text, numbers, booleans, UUIDs, times)."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, models

M = TypeVar("M", bound=models.Model)


def columns(model: type[models.Model], alias: str) -> str:
    """`alias."column", ...` for every concrete field of `model`, in the order `build` takes them."""
    return ", ".join(f'{alias}."{field.column}"' for field in model._meta.concrete_fields)


@functools.cache
def _attnames(model: type[models.Model]) -> list[str]:
    return [field.attname for field in model._meta.concrete_fields]


def width(model: type[models.Model]) -> int:
    return len(_attnames(model))


def build(model: type[M], values: tuple[Any, ...] | list[Any]) -> M:
    """The model instance for one row's values of `columns(model, ...)`."""
    return model.from_db(DEFAULT_DB_ALIAS, _attnames(model), list(values))
