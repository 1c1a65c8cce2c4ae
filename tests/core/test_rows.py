"""Rows read by compiled SQL (apps.core.rows) are built into the same instances the ORM builds: for each
model the request path and the agents' reads build, an instance from `rows.build` equals the ORM's in
type, every value and state; models `Model.__init__` would do more for, and any pre_init or post_init
receiver, still get Django's own construction."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, models
from django.db.models.signals import post_init, pre_init
from django_tenants.utils import schema_context

from apps.accounts.models import ApiToken, User
from apps.core import rows
from apps.scheduling.models import Task, TaskRun
from tenants.models import Tenant
from tests.world import World

pytestmark = pytest.mark.django_db


def read(model: type[models.Model], pk: Any) -> tuple[Any, ...]:
    table = connection.ops.quote_name(model._meta.db_table)
    with connection.cursor() as cursor:
        where = f"r.{model._meta.pk.column} = %s"
        cursor.execute(f"SELECT {rows.columns(model, 'r')} FROM {table} r WHERE {where}", [pk])  # noqa: S608
        found = cursor.fetchone()
    assert found is not None
    return tuple(found)


def values(instance: models.Model) -> dict[str, Any]:
    return {name: value for name, value in vars(instance).items() if name != "_state"}


def same_as_orm(instance: models.Model, orm: models.Model) -> None:
    assert type(instance) is type(orm)
    assert values(instance) == values(orm)
    assert list(vars(instance)) == list(vars(orm))  # the same attributes, in the same order
    assert (instance._state.adding, instance._state.db) == (False, DEFAULT_DB_ALIAS)
    assert instance == orm
    assert hash(instance) == hash(orm)


def test_the_request_path_s_models_are_built_by_assignment(world: World) -> None:
    for model in (Tenant, User, ApiToken, Task, TaskRun):
        assert rows._plain(model), model


def test_each_is_built_as_the_orm_builds_it(world: World) -> None:
    same_as_orm(rows.build(Tenant, read(Tenant, world.tenant_a.pk)), Tenant.objects.get(pk=world.tenant_a.pk))
    with schema_context(world.tenant_a.schema_name):
        token = ApiToken.objects.get(pk=world.token_ids["bob"])
        built = rows.build(ApiToken, read(ApiToken, token.pk))
        same_as_orm(built, token)
        assert built.user == User.objects.get(username="bob")  # its foreign key read as the ORM's
        same_as_orm(rows.build(User, read(User, token.user_id)), User.objects.get(pk=token.user_id))
        task = Task.objects.get(pk=world.task_a)
        same_as_orm(rows.build(Task, read(Task, task.pk)), task)
        built_task = rows.build(Task, read(Task, task.pk))
        built_task.name = "renamed"  # and it saves as the ORM's would
        built_task.save(update_fields=["name"])
        assert Task.objects.get(pk=task.pk).name == "renamed"


def test_a_receiver_of_pre_init_or_post_init_gets_django_s_construction(world: World) -> None:
    row = read(Tenant, world.tenant_a.pk)
    for signal in (pre_init, post_init):
        heard: list[Any] = []

        def receiver(sender: Any, **kwargs: Any) -> None:
            heard.append(sender)  # noqa: B023 -- called before the loop moves on

        signal.connect(receiver, sender=Tenant)
        try:
            same_as_orm(rows.build(Tenant, row), Tenant.objects.get(pk=world.tenant_a.pk))
        finally:
            signal.disconnect(receiver, sender=Tenant)
        assert heard.count(Tenant) == 2, signal  # once for rows.build, once for the ORM's


class Counted(models.Model):
    """A model whose `__init__` does more than assign."""

    name = models.CharField(max_length=10)
    built = 0

    class Meta:
        app_label = "core"
        managed = False

    def __str__(self) -> str:
        return self.name

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Counted.built += 1


class Guarded:
    """A field attribute that does more than store the value."""

    def __get__(self, instance: Any, owner: Any) -> Any:
        return self if instance is None else instance.__dict__["name"]

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__["name"] = value.upper()


class Shouted(models.Model):
    name = models.CharField(max_length=10)

    class Meta:
        app_label = "core"
        managed = False

    def __str__(self) -> str:
        return self.name


Shouted.name = Guarded()  # type: ignore[assignment]


def test_a_model_whose_construction_does_more_gets_django_s() -> None:
    assert not rows._plain(Counted)
    assert not rows._plain(Shouted)
    before = Counted.built
    assert rows.build(Counted, (1, "a")).name == "a"
    assert Counted.built == before + 1
    assert rows.build(Shouted, (1, "a")).name == "A"
