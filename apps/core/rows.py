"""Rows read on every request, by SQL compiled once: the ORM compiles a query each time it runs (over a
millisecond for a join), which on the request path costs more than PostgreSQL's answer. Each reader
selects every concrete column of its models and builds them as the ORM does (`Model.from_db`, each value
first converted by its field's and the backend's converters: a JSONField's text parsed), so what callers
get is the same objects."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, models

M = TypeVar("M", bound=models.Model)


def columns(model: type[models.Model], alias: str) -> str:
    """`alias."column", ...` for every concrete field of `model`, in the order `build` takes them."""
    return ", ".join(f'{alias}."{field.column}"' for field in model._meta.concrete_fields)


@functools.cache
def _attnames(model: type[models.Model]) -> list[str]:
    return [field.attname for field in model._meta.concrete_fields]


Converter = Callable[[Any, Any, Any], Any]


@functools.cache
def _converted(model: type[models.Model]) -> tuple[tuple[int, tuple[Converter, ...], Any], ...]:
    """For each of `model`'s columns that the ORM converts as it reads it: its place, its converters (the
    backend's, then the field's, as the ORM's compiler orders them) and the column they are given."""
    connection = connections[DEFAULT_DB_ALIAS]
    found = []
    for place, field in enumerate(model._meta.concrete_fields):
        column = field.get_col(model._meta.db_table)
        converters = connection.ops.get_db_converters(column) + column.get_db_converters(connection)
        if converters:
            found.append((place, tuple(converters), column))
    return tuple(found)


def width(model: type[models.Model]) -> int:
    return len(_attnames(model))


def build(model: type[M], values: tuple[Any, ...] | list[Any]) -> M:
    """The model instance for one row's values of `columns(model, ...)`."""
    names = _attnames(model)
    if len(values) != len(names):
        raise ValueError(
            f"{model.__name__} has {len(names)} columns; a row of {len(values)} values was given"
        )
    converted = _converted(model)
    if converted:
        values, connection = list(values), connections[DEFAULT_DB_ALIAS]
        for place, converters, column in converted:
            for converter in converters:
                values[place] = converter(values[place], column, connection)
    return model.from_db(DEFAULT_DB_ALIAS, names, list(values))
