"""Rows read on every request, by SQL compiled once: the ORM compiles a query each time it runs (over a
millisecond for a join), which on the request path costs more than PostgreSQL's answer. Each reader
selects every concrete column of its models and builds them as the ORM does (`Model.from_db`, each value
first converted by its field's and the backend's converters: a JSONField's text parsed), so what callers
get is the same objects.

A model whose instances `Model.__init__` builds by plain assignment (no `__init__` or `from_db` of its own,
no field descriptor that does more than store the value, no pre_init or post_init receiver anywhere) is
built without it: the same instance, its values and its state as `from_db` leaves them, for half
the cost (three per API call: the tenant, the token and its user)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.models.base import ModelState
from django.db.models.fields.related_descriptors import ForeignKeyDeferredAttribute
from django.db.models.query_utils import DeferredAttribute
from django.db.models.signals import post_init, pre_init

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


# What a field's attribute may be for an instance to be built by assignment: Django's deferred attribute
# (it stores nothing) and a foreign key's (on a new instance, it only stores the value).
_PLAIN_ATTRIBUTES = (DeferredAttribute, ForeignKeyDeferredAttribute)


@functools.cache
def _plain(model: type[models.Model]) -> bool:
    """Whether `Model.__init__` builds `model`'s instances by assigning each field's value, no more."""
    from_db = model.from_db.__func__  # type: ignore[attr-defined]
    own = model.__init__ is not models.Model.__init__ or from_db is not models.Model.from_db.__func__  # type: ignore[attr-defined]
    return not own and all(type(model.__dict__.get(name)) in _PLAIN_ATTRIBUTES for name in _attnames(model))


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
    if not _plain(model) or pre_init.receivers or post_init.receivers:
        return model.from_db(DEFAULT_DB_ALIAS, names, list(values))
    instance = model.__new__(model)
    state = instance._state = ModelState()
    state.adding, state.db = False, DEFAULT_DB_ALIAS
    instance.__dict__.update(zip(names, values, strict=True))
    return instance
