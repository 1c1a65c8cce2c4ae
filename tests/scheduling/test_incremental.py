"""Incremental cycles in the control plane (apps/scheduling/incremental.py, reads.py): the rows changed since
a read are exactly those a later read must see, whatever order transactions commit in; a kept tenant's cycles
decide what full cycles would, and its kept state is the database's after every cycle; anything the kept
state cannot follow (a configuration change, the time for a full read, a rollback, a small queue) reads
everything."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.utils import timezone
from django_tenants.utils import schema_context

from apps.accounts.models import User
from apps.provider.services import tenant_delete
from apps.resources.models import ComputeResource, Pool, ResourceProfile
from apps.scheduling import cycle, engine, incremental, lifecycle, reads
from apps.scheduling.cycle import run_cycle
from apps.scheduling.engine.state import Usage
from apps.scheduling.models import ACTIVE_STATES, Task, TaskState
from apps.scheduling.services import TaskRequest, task_cancel, tasks_submit
from tenants.models import Tenant
from tests.scheduling.config import acme_tenant
from tests.world import World

SLUG = "incremental"
RESOURCES = ["Research: 4 GPUs", "Research: shared GPU", "Research: MIG slice", "Dev: 4 GPUs"]


@pytest.fixture
def tenant(django_db_blocker: Any, world: World, settings: Any) -> Iterator[Tenant]:
    """A tenant whose rows are really committed (a cycle is kept only once its transaction commits), kept
    from its first queued task on."""
    settings.KLIQUE_CYCLE_INCREMENTAL_FROM = 0
    incremental.forget()
    with django_db_blocker.unblock():
        created = acme_tenant(slug=SLUG, name="Incremental", admin="ines")
        with schema_context(SLUG):
            yield created
        incremental.forget()
        tenant_delete(tenant=Tenant.objects.get(slug=SLUG))


def submit(tenant: Tenant, resource: str, count: int) -> list[Task]:
    ines = User.objects.get(username="ines")
    gpus = "0.5" if resource == "Research: shared GPU" else None
    return tasks_submit(
        tenant=tenant,
        user=ines,
        requests=[TaskRequest(compute_resource=resource, gpus=gpus) for _ in range(count)],
    )


class FullReads:
    """Counts the cycles that read every task."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.original = reads.tasks

        def counted(now: Any) -> reads.Tasks:
            self.count += 1
            return self.original(now)

        monkeypatch.setattr(reads, "tasks", counted)


def kept_matches_the_database(tenant: Tenant) -> incremental.Kept:
    """The kept tenant holds what its rows say: every queued task in its queue (or held back), every
    task holding GPUs in its pool with its size, and the reasons the queued tasks show."""
    kept = incremental._kept[tenant.schema_name]
    resident = kept.resident
    queued = {
        str(pk): str(resource)
        for pk, resource in Task.objects.filter(state=TaskState.QUEUED).values_list("pk", "compute_resource")
    }
    assert {**resident.queue_of, **{key: task.queue for key, task in kept.held.items()}} == queued
    holding = {
        str(pk): (str(pool), size)
        for pk, pool, size in Task.objects.filter(state__in=ACTIVE_STATES).values_list(
            "pk", "pool", "size_units"
        )
    }
    assert {key: (run.pool, run.size) for key, run in resident.running.items()} == holding
    shown = {
        str(pk): (code, reason)
        for pk, code, reason in Task.objects.filter(state=TaskState.QUEUED).values_list(
            "pk", "reason_code", "reason"
        )
    }
    assert kept.shown == shown
    usage = Usage.of(resident.running.values(), resident.queue_policy)
    for pool in set(usage.pool_used) | set(resident.usage.pool_used):
        assert resident.usage.pool_used[pool] == usage.pool_used[pool]
    for policy in set(usage.policy_used) | set(resident.usage.policy_used):
        assert resident.usage.policy_used[policy] == usage.policy_used[policy]
    return kept


def full_decision(tenant: Tenant, full: FullReads) -> engine.Decision:
    """What a full cycle would decide now (from a read of its own, not counted)."""
    with transaction.atomic():
        now = timezone.now()
        read = full.original(now)
        return engine.schedule(reads.whole(reads.configuration(tenant, now), read, now, frozenset()))


def horizon_now() -> int:
    """The horizon of a read made now."""
    return reads.changed_since(2**62)[1]


# -- the rows changed since a read -----------------------------------------------------------------------


def stamps() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT id::text, changed_xid FROM scheduling_task")
        return dict(cursor.fetchall())


def test_what_the_engine_sees_of_a_task_stamps_it_and_nothing_else_does(tenant: Tenant) -> None:
    tasks = submit(tenant, "Research: 4 GPUs", 5)
    before = stamps()
    assert all(before.values())  # an insert is stamped

    Task.objects.filter(pk=tasks[0].pk).update(priority=7)
    Task.objects.filter(pk=tasks[1].pk).update(state=TaskState.COMPLETED, ended_at=timezone.now())
    Task.objects.filter(pk=tasks[2].pk).update(
        name="renamed", spec={"command": ["true"]}, idempotency_key="k"
    )
    Task.objects.filter(pk=tasks[3].pk).update(reason_code="retrying", reason="again")
    Task.objects.filter(pk=tasks[4].pk).update(priority=0, size_units=tasks[4].size_units)  # the same values
    after = stamps()
    assert {key for key in before if after[key] != before[key]} == {
        str(tasks[0].pk),
        str(tasks[1].pk),
        str(tasks[3].pk),
    }
    assert all(after[str(tasks[i].pk)] > before[str(tasks[i].pk)] for i in (0, 1, 3))


def test_a_read_of_changes_returns_every_row_stamped_since_its_horizon(tenant: Tenant) -> None:
    tasks = submit(tenant, "Research: 4 GPUs", 3)
    since = horizon_now()
    Task.objects.filter(pk=tasks[0].pk).update(priority=7)
    Task.objects.filter(pk=tasks[1].pk).update(state=TaskState.COMPLETED, ended_at=timezone.now())
    more = submit(tenant, "Dev: 4 GPUs", 1)

    rows, horizon = reads.changed_since(since)
    changed = {row[0]: row for row in rows}
    # Other transactions open on the server hold a horizon back, so older rows may come too; never fewer.
    assert changed.keys() == {key for key, stamp in stamps().items() if stamp >= since}
    assert {str(tasks[0].pk), str(tasks[1].pk), str(more[0].pk)} <= changed.keys()
    assert changed[str(tasks[0].pk)][7] == 7  # read as it is now
    assert reads.as_engine(changed[str(tasks[1].pk)], 0.0) is None  # ended: neither queued nor holding
    queued = reads.as_engine(changed[str(more[0].pk)], 0.0)
    assert isinstance(queued, engine.Task)
    assert queued.queue == str(ComputeResource.objects.get(name="Dev: 4 GPUs").pk)
    assert horizon >= since


def test_a_stale_instance_saved_does_not_take_the_stamp_back(tenant: Tenant) -> None:
    (task,) = submit(tenant, "Research: 4 GPUs", 1)
    stale = Task.objects.get(pk=task.pk)
    since = horizon_now()
    Task.objects.filter(pk=task.pk).update(priority=3)
    stale.name = "renamed"
    stale.save(update_fields=["name"])
    assert [row[0] for row in reads.changed_since(since)[0]] == [str(task.pk)]
    stale.save()  # every column, the old priority among them: a change again
    (row,) = reads.changed_since(since)[0]
    assert row[7] == 0


def test_a_transaction_open_across_a_read_is_in_the_next_read_once_it_commits(tenant: Tenant) -> None:
    """Transaction ids are not commit order: a change made by a transaction that began before a read and
    commits after it carries an older id than changes the read saw. The horizon keeps it."""
    first, second = submit(tenant, "Research: 4 GPUs", 2)
    since = horizon_now()
    params = connection.get_connection_params()
    dsn = {key: params[key] for key in ("host", "port", "user", "dbname") if key in params}
    with psycopg.connect(**dsn) as other:
        other.execute(f'SET search_path TO "{tenant.schema_name}"')
        other.execute(
            "UPDATE scheduling_task SET priority = 5 WHERE id = %s", [first.pk]
        )  # open, not committed
        Task.objects.filter(pk=second.pk).update(priority=6)  # a later transaction, committed now

        rows, horizon = reads.changed_since(since)
        seen = {row[0]: row[7] for row in rows}
        assert seen[str(second.pk)] == 6
        assert seen.get(str(first.pk), 0) == 0  # the open transaction's change is not visible yet
        other.commit()

    rows, _ = reads.changed_since(horizon)
    assert {row[0]: row[7] for row in rows}[str(first.pk)] == 5  # although its id is older than the read


def test_a_tenant_made_from_the_template_stamps_its_tasks(tenant: Tenant) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT tgname FROM pg_trigger JOIN pg_class ON pg_class.oid = tgrelid
                JOIN pg_namespace ON pg_namespace.oid = relnamespace
               WHERE nspname = %s AND relname = 'scheduling_task' AND NOT tgisinternal ORDER BY tgname""",
            [tenant.schema_name],
        )
        assert [name for (name,) in cursor.fetchall()] == [
            "scheduling_task_stamp_insert",
            "scheduling_task_stamp_update",
        ]
    (task,) = submit(tenant, "Research: 4 GPUs", 1)
    with connection.cursor() as cursor:
        cursor.execute("SELECT changed_xid FROM scheduling_task WHERE id = %s", [task.pk])
        assert cursor.fetchone()[0] > 0


# -- cycles ------------------------------------------------------------------------------------------------


def test_a_kept_tenant_reads_only_what_changed(tenant: Tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    full = FullReads(monkeypatch)
    submit(tenant, "Research: 4 GPUs", 6)
    first = run_cycle(tenant)
    assert (first.queued, first.placed) == (6, 4)  # research's limit: 16 GPUs
    assert full.count == 1
    kept_matches_the_database(tenant)

    submit(tenant, "Research: 4 GPUs", 2)  # research is at its limit
    second = run_cycle(tenant)
    assert full.count == 1  # read only what changed
    assert (second.queued, second.placed) == (4, 0)
    kept = kept_matches_the_database(tenant)
    assert all(code for code, _ in kept.shown.values())  # every task waiting says why

    placed = Task.objects.filter(state=TaskState.PLACED).order_by("placed_at", "pk")
    Task.objects.filter(pk__in=[task.pk for task in placed[:2]]).update(
        state=TaskState.COMPLETED, ended_at=timezone.now()
    )
    third = run_cycle(tenant)
    assert full.count == 1
    assert third.placed == 2
    kept_matches_the_database(tenant)
    assert full_decision(tenant, full).placements == ()


def test_kept_cycles_decide_what_full_cycles_would(tenant: Tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random arrivals, ends, cancellations and requeues between cycles; after each step's cycles the kept
    state is the database's, and a full cycle of the same state would place and preempt nothing more."""
    full = FullReads(monkeypatch)
    rng = random.Random(21)
    for step in range(12):
        for _ in range(rng.randint(0, 3)):
            submit(tenant, rng.choice(RESOURCES), rng.randint(1, 3))
        holding = list(Task.objects.filter(state__in=ACTIVE_STATES).values_list("pk", flat=True))
        ended = rng.sample(holding, min(len(holding), rng.randint(0, 2)))
        Task.objects.filter(pk__in=ended).update(state=TaskState.COMPLETED, ended_at=timezone.now())
        waiting = list(Task.objects.filter(state=TaskState.QUEUED))
        for task in rng.sample(waiting, min(len(waiting), rng.randint(0, 1))):
            task_cancel(tenant=tenant, user=User.objects.get(username="ines"), task=task)
        if step % 4 == 3 and holding:  # a run lost: its task goes back to the queue
            Task.objects.filter(pk=rng.choice(holding), state__in=ACTIVE_STATES).update(
                state=TaskState.QUEUED, pool=None, reason_code="retrying", reason="its run was lost"
            )
        for _ in range(10):
            result = run_cycle(tenant)
            if not result.placed and not result.preempted:
                break
        kept_matches_the_database(tenant)
        decision = full_decision(tenant, full)
        assert (decision.placements, decision.preemptions) == ((), ()), step
    assert full.count == 1


def test_a_configuration_change_reads_everything(tenant: Tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    full = FullReads(monkeypatch)
    submit(tenant, "Research: 4 GPUs", 6)
    run_cycle(tenant)
    run_cycle(tenant)
    assert full.count == 1
    Pool.objects.filter(name="h100").update(capacity_gpus=16)
    result = run_cycle(tenant)
    assert full.count == 2
    assert result.placed == 0  # research is at its limit (16 GPUs), wherever the room is
    ComputeResource.objects.filter(name="Research: 4 GPUs").update(queuing_priority=3)
    run_cycle(tenant)
    assert full.count == 3
    kept_matches_the_database(tenant)


def test_everything_is_read_again_when_a_full_read_is_due(
    tenant: Tenant, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    full = FullReads(monkeypatch)
    submit(tenant, "Research: 4 GPUs", 2)
    run_cycle(tenant)
    run_cycle(tenant)
    assert full.count == 1
    settings.KLIQUE_CYCLE_FULL_SECONDS = 0
    run_cycle(tenant)
    run_cycle(tenant)
    assert full.count == 3


def cycle_then_roll_back(tenant: Tenant) -> None:
    with transaction.atomic():
        submit(tenant, "Research: 4 GPUs", 1)
        Task.objects.filter(state=TaskState.PLACED).update(state=TaskState.COMPLETED)
        assert run_cycle(tenant).placed == 3  # the kept tenant, caught up
        raise RuntimeError("the transaction the cycle ran in is rolled back")


def test_a_cycle_rolled_back_keeps_nothing(tenant: Tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    full = FullReads(monkeypatch)
    submit(tenant, "Research: 4 GPUs", 6)
    run_cycle(tenant)
    with pytest.raises(RuntimeError, match="rolled back"):
        cycle_then_roll_back(tenant)
    assert tenant.schema_name not in incremental._kept
    assert full.count == 1
    result = run_cycle(tenant)
    assert full.count == 2
    assert (result.queued, result.placed) == (2, 0)
    kept_matches_the_database(tenant)


def test_a_cycle_that_fails_keeps_nothing(tenant: Tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    full = FullReads(monkeypatch)
    submit(tenant, "Research: 4 GPUs", 6)
    run_cycle(tenant)

    def broken(*args: Any, **kwargs: Any) -> int:
        raise ConnectionError("the database went away")

    with monkeypatch.context() as patch:
        patch.setattr(lifecycle, "tasks_place", broken)
        Task.objects.filter(state=TaskState.PLACED).update(state=TaskState.COMPLETED)
        with pytest.raises(ConnectionError):
            run_cycle(tenant)
    assert tenant.schema_name not in incremental._kept
    assert run_cycle(tenant).placed == 2
    assert full.count == 2
    kept_matches_the_database(tenant)


def test_a_small_queue_is_not_kept(tenant: Tenant, monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    settings.KLIQUE_CYCLE_INCREMENTAL_FROM = 10
    full = FullReads(monkeypatch)
    submit(tenant, "Research: 4 GPUs", 9)
    run_cycle(tenant)  # 9 queued when read
    run_cycle(tenant)
    assert full.count == 2
    assert tenant.schema_name not in incremental._kept
    submit(tenant, "Research: MIG slice", 10)
    run_cycle(tenant)
    assert tenant.schema_name in incremental._kept
    run_cycle(tenant)
    assert full.count == 3


def test_tasks_held_by_a_budget_leave_the_kept_queues_and_come_back(
    tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = FullReads(monkeypatch)
    waiting = submit(tenant, "Research: 4 GPUs", 6)
    held = {str(waiting[0].pk): "Waiting for budget: the project's budget is spent."}
    monkeypatch.setattr(cycle, "_held_by_budgets", lambda now: dict(held))
    assert run_cycle(tenant).placed == 4
    kept = kept_matches_the_database(tenant)
    assert set(kept.held) == set(held)
    assert Task.objects.get(pk=waiting[0].pk).state == TaskState.QUEUED

    assert run_cycle(tenant).placed == 0  # after it, the rows of the tasks waiting change no more
    (other,) = Task.objects.filter(state=TaskState.QUEUED).exclude(pk=waiting[0].pk)
    held[str(other.pk)] = "Waiting for budget: the user's budget is spent."  # held since
    Task.objects.filter(state=TaskState.PLACED).update(state=TaskState.COMPLETED, ended_at=timezone.now())
    assert run_cycle(tenant).placed == 0
    assert Task.objects.get(pk=other.pk).reason_code == "budget_exhausted"
    kept = kept_matches_the_database(tenant)
    assert set(kept.held) == set(held)

    held.clear()  # the budgets topped up
    assert run_cycle(tenant).placed == 2
    assert kept_matches_the_database(tenant).held == {}
    assert full.count == 1


def test_the_configuration_read_as_rows_is_the_models(tenant: Tenant) -> None:
    """Pools offline and online, with fractions, static and dynamic MIG or neither; profiles with pools in
    order and with none, a starvation bound, strict FIFO; policies and compute resources: as the models
    say."""
    now = timezone.now()
    Pool.objects.filter(name="h100").update(last_heartbeat_at=now - timedelta(days=2))  # past its timeout
    Pool.objects.create(
        name="dynamic",
        environment="baremetal",
        capacity_gpus=2,
        sharing=["mig_dynamic"],
        last_heartbeat_at=now,
    )
    ResourceProfile.objects.create(name="no-pools", starvation_seconds=600, strict_fifo=True)

    read = reads.configuration(tenant, now)

    def sharing(pool: Pool) -> frozenset[engine.Sharing]:
        kinds = {engine.Sharing.WHOLE}
        kinds |= {engine.Sharing.FRACTION} if "fraction" in pool.sharing else set()
        kinds |= {engine.Sharing.MIG} if {"mig_static", "mig_dynamic"} & set(pool.sharing) else set()
        return frozenset(kinds)

    assert read.pools == tuple(
        engine.Pool(str(p.pk), p.capacity_gpus * engine.UNITS_PER_GPU, p.is_online(now), sharing(p), p.name)
        for p in Pool.objects.order_by("name")
    )
    assert {pool.label: pool.online for pool in read.pools} == {
        "baremetal": True,
        "dynamic": True,
        "h100": False,
    }
    assert {pool.label: pool.sharing for pool in read.pools}["dynamic"] == {
        engine.Sharing.WHOLE,
        engine.Sharing.MIG,
    }
    profiles = {profile.id: profile for profile in read.profiles}
    for profile in ResourceProfile.objects.all():
        order = list(profile.pool_order.order_by("position"))
        assert profiles[str(profile.pk)] == engine.Profile(
            str(profile.pk),
            tuple(str(entry.pool_id) for entry in order),
            {str(entry.pool_id): entry.execution_priority for entry in order},
            profile.strict_fifo,
            float(profile.starvation_seconds) if profile.starvation_seconds else None,
        )
    assert profiles[str(ResourceProfile.objects.get(name="no-pools").pk)].pools == ()
    assert {policy.name: (policy.reservation, policy.limit) for policy in read.policies} == {
        "research": (8 * engine.UNITS_PER_GPU, 16 * engine.UNITS_PER_GPU),
        "dev": (8 * engine.UNITS_PER_GPU, 16 * engine.UNITS_PER_GPU),
    }
    assert set(read.queues) == {
        engine.Queue(str(pk), str(policy), str(profile), priority)
        for pk, policy, profile, priority in ComputeResource.objects.values_list(
            "pk", "policy_id", "profile_id", "queuing_priority"
        )
    }
    assert reads.configuration(tenant, now) == read  # nothing changed: equal
