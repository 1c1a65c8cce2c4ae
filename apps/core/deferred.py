"""Writes whose outcome nobody waits for, sent with the statement after them rather than alone.

An agent's burst of messages (apps.fleet.consumers) is applied in one thread, one statement after another;
most of its writes (a run's start, a task's new state, its event) ask nothing of the database but to be done,
and each alone cost a round trip. Within `writes_deferred()`, `update_fields` and `insert` (and their forms
for many rows, `update_many` and `insert_many`) keep such a write, and the next statement the connection sends
(any: the ORM's, a cursor's) carries the kept writes before it, in one message: statements separated by
semicolons, bound on the client as Klique's connections bind them. What is still kept when the block ends is
sent then, so the block must end inside the transaction it was opened in, before that commits. Outside a block
each write is sent at once.

- Order is kept: the kept writes run before whatever is sent next, so every read sees them, and a
  savepoint taken next is taken after them (rolling back to it does not undo them).
- Keep only writes that cannot fail but by the database failing: an UPDATE by key of a row the transaction
  holds locked, an INSERT of a row that refers to such rows. An error in a kept write is raised by the
  statement that carried it and aborts the transaction, as any error would.
- A block left by an exception sends nothing of what it kept: the transaction it is in is undone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from django.db import connection, models


@dataclass
class _Kept:
    statements: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)

    def take(self) -> tuple[list[str], list[Any]]:
        taken = self.statements, self.params
        self.statements, self.params = [], []
        return taken


_kept: ContextVar[_Kept | None] = ContextVar("klique_writes_kept", default=None)


@contextmanager
def writes_deferred() -> Iterator[None]:
    """Within: `update_fields` and `insert` are sent with the next statement (see the module). Open it in
    a transaction; within a block already open, it is that block's."""
    if _kept.get() is not None:
        yield
        return
    if not connection.in_atomic_block:
        raise RuntimeError("writes are deferred only within a transaction, which the block ends before")
    kept = _Kept()
    opened = _kept.set(kept)
    try:
        with connection.execute_wrapper(_carry(kept)):
            yield
            _send(kept)
    finally:
        _kept.reset(opened)


def update_fields(instance: models.Model, names: Sequence[str]) -> None:
    """`instance.save(update_fields=names)` with no signals and no count of the rows it changed: for a row
    the transaction holds locked."""
    model = type(instance)
    fields = _fields(model, tuple(names))
    values = [f.get_db_prep_save(getattr(instance, f.attname), connection) for f in fields]
    pk = model._meta.pk
    assert pk is not None
    _write(_update_sql(model, tuple(names)), [*values, pk.get_db_prep_value(instance.pk, connection)])


def insert(instance: models.Model, *, keyed: bool = False) -> None:
    """`instance.save()` of a new row with no signals, whose key the database makes and nobody reads back
    (an event of a task): no RETURNING, and the instance's key is left unset. `keyed`: the row's key is
    the instance's, taken by the caller from the key's sequence."""
    _write(insert_sql(type(instance), keyed), insert_values(instance, keyed))


def insert_many(instances: Sequence[models.Model]) -> None:
    """`bulk_create` of new rows of one model with no signals and no RETURNING (the keys the database
    makes are left unset): one multi-row INSERT, kept within a block, else sent at once."""
    if not instances:
        return
    model = type(instances[0])
    row = f"({', '.join(['%s'] * len(_inserted(model)))})"
    sql = insert_sql(model) + f", {row}" * (len(instances) - 1)
    _write(sql, [value for instance in instances for value in insert_values(instance)])
    for instance in instances:
        instance._state.adding, instance._state.db = False, connection.alias


def update_many(instances: Sequence[models.Model], names: Sequence[str]) -> None:
    """`update_fields` of each instance (rows the transaction holds locked), their statements sent in one
    message: kept within a block, else at once."""
    if not instances:
        return
    model = type(instances[0])
    fields, pk = _fields(model, tuple(names)), model._meta.pk
    assert pk is not None
    params = [
        value
        for instance in instances
        for value in (
            *(f.get_db_prep_save(getattr(instance, f.attname), connection) for f in fields),
            pk.get_db_prep_value(instance.pk, connection),
        )
    ]
    _write("; ".join([_update_sql(model, tuple(names))] * len(instances)), params)


def insert_values(instance: models.Model, keyed: bool = False) -> list[Any]:
    """The values of `insert_sql(type(instance), keyed)` for this new row, its defaults and automatic
    times set."""
    return [
        f.get_db_prep_save(f.pre_save(instance, True), connection) for f in _inserted(type(instance), keyed)
    ]


def _write(sql: str, params: list[Any]) -> None:
    kept = _kept.get()
    if kept is None:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
    else:
        kept.statements.append(sql)
        kept.params.extend(params)


def _carry(kept: _Kept) -> Callable[..., Any]:
    """The connection's execute wrapper within a block: the kept writes go before the statement, in its
    message, and its cursor is moved past their results to its own."""

    def carried(
        execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
    ) -> Any:
        if not kept.statements:
            return execute(sql, params, many, context)
        if many or isinstance(params, Mapping) or (params is None and "%" in sql):
            _send(kept)  # placeholders of another style, or none: the writes go alone, just before it
            return execute(sql, params, many, context)
        statements, carried_params = kept.take()
        result = execute("; ".join([*statements, sql]), [*carried_params, *(params or ())], many, context)
        cursor = context["cursor"].cursor
        for _ in statements:
            cursor.nextset()
        return result

    return carried


def _send(kept: _Kept) -> None:
    if kept.statements:
        statements, params = kept.take()
        with connection.cursor() as cursor:
            cursor.execute("; ".join(statements), params)


@functools.cache
def _fields(model: type[models.Model], names: tuple[str, ...]) -> list[models.Field[Any, Any]]:
    return [model._meta.get_field(name) for name in names]  # type: ignore[misc]


@functools.cache
def _update_sql(model: type[models.Model], names: tuple[str, ...]) -> str:
    quote = connection.ops.quote_name
    pk = model._meta.pk
    assert pk is not None
    assignments = ", ".join(f"{quote(str(f.column))} = %s" for f in _fields(model, names))
    return f"UPDATE {quote(model._meta.db_table)} SET {assignments} WHERE {quote(str(pk.column))} = %s"  # noqa: S608 -- the model's own names


@functools.cache
def _inserted(model: type[models.Model], keyed: bool = False) -> list[models.Field[Any, Any]]:
    """The columns an insert writes: every concrete one but a key the database makes (unless `keyed`)."""
    return [f for f in model._meta.concrete_fields if keyed or not getattr(f, "db_returning", False)]


@functools.cache
def insert_sql(model: type[models.Model], keyed: bool = False) -> str:
    """`INSERT INTO <table> (<columns>) VALUES (%s, ...)` of every concrete column but a key the database
    makes (`keyed`: that too): a caller may add a conflict clause or a RETURNING of its own."""
    quote = connection.ops.quote_name
    fields = _inserted(model, keyed)
    columns = ", ".join(quote(str(f.column)) for f in fields)
    values = ", ".join(["%s"] * len(fields))
    return f"INSERT INTO {quote(model._meta.db_table)} ({columns}) VALUES ({values})"  # noqa: S608 -- the model's own names
