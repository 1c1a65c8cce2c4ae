"""Periodic work only for tenants that have some due (tenants/due.py): what marks a tenant, how the work
settles its mark without losing an event that comes during it, beat sending only to marked tenants, and
the walk that finds in pages what no mark announced (marks lost with Redis, work that comes with time)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import current_app
from django.utils import timezone
from django_tenants.utils import schema_context

import apps.accounts.tasks
import apps.fleet.tasks
import apps.scheduling.tasks
import gateway.tasks
from apps.accounts.models import ApiToken
from apps.scheduling.models import Task, TaskState, WaitObjective
from tenants import due
from tenants.models import Tenant
from tenants.tasks import for_marked_tenants, walk_due
from tests.world import World


@pytest.fixture
def clean(world: World, db: None) -> Iterator[None]:
    def wipe() -> None:
        due.client().delete(*[due.key(kind) for kind in due.KINDS], due.CURSOR)

    wipe()
    due.client().set(due.KEPT, "1")  # the marks are Redis's own: none was lost
    yield
    wipe()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...]]]:
    """What beat's entry points send, caught instead of queued."""
    caught: list[tuple[str, tuple[Any, ...]]] = []
    monkeypatch.setattr(
        current_app, "send_task", lambda name, args=(), **_: caught.append((name, tuple(args)))
    )
    return caught


def marks(kind: str) -> set[str]:
    return due.marked([kind])


def at_rest() -> None:
    """acme with nothing in play: its tasks ended, no objective, no token to purge, no output kept."""
    Task.objects.exclude(state__in=(TaskState.COMPLETED, TaskState.FAILED, TaskState.ABORTED)).update(
        state=TaskState.COMPLETED
    )
    WaitObjective.objects.all().delete()


def test_tenants_at_rest_are_sent_nothing(clean: None, sent: list[Any]) -> None:
    for task, kinds in (
        ("scheduling.run_cycle", ["cycle"]),
        ("metering.gateway_calls", ["gateway_calls"]),
        ("scheduling.objectives", ["cycle", "objectives"]),
        ("metering.storage", ["storage"]),
        ("accounts.token_purge_expired", ["token_purge"]),
    ):
        assert for_marked_tenants(task, kinds) == 0
    assert sent == []


def test_a_submission_marks_its_tenant_for_cycles_until_nothing_is_in_play(
    clean: None,
    sent: list[Any],
    world: World,
    api: Callable[..., Any],
    django_capture_on_commit_callbacks: Any,
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        answer = api("bob").post(
            "/api/v1/tasks/", {"compute_resource": "Research: 4 GPUs", "name": "marks"}, format="json"
        )
    assert answer.status_code == 201, answer.content
    assert marks("cycle") == {"acme"}
    assert for_marked_tenants("scheduling.run_cycle", ["cycle"]) == 1
    assert ("scheduling.run_cycle", ("acme",)) in sent

    apps.scheduling.tasks.scheduling_cycle("acme")  # work is still queued: still due
    assert marks("cycle") == {"acme"}
    with schema_context("acme"):
        at_rest()
    apps.scheduling.tasks.scheduling_cycle("acme")  # nothing in play: settled
    assert marks("cycle") == set()
    sent.clear()
    assert for_marked_tenants("scheduling.run_cycle", ["cycle"]) == 0
    assert sent == []


def test_an_event_during_the_work_keeps_the_mark(clean: None) -> None:
    with schema_context("acme"):
        at_rest()
        due.mark("acme", "cycle")
        due.settle("acme", "cycle", lambda: due.mark("acme", "cycle"))  # a submit lands while it runs
        assert marks("cycle") == {"acme"}
        due.settle("acme", "cycle", lambda: None)
        assert marks("cycle") == set()


def test_work_that_fails_stays_due(clean: None) -> None:
    def fails() -> None:
        raise ConnectionError("PostgreSQL went away")

    with schema_context("acme"):
        at_rest()
        due.mark("acme", "cycle")
        with pytest.raises(ConnectionError):
            due.settle("acme", "cycle", fails)
    assert marks("cycle") == {"acme"}


def test_the_walk_finds_in_pages_what_no_mark_announced(clean: None, world: World) -> None:
    """Marks lost (Redis restarted empty) and work that came with time: a token turned purgeable, an
    objective without this hour's sample, tasks in play; a tenant at rest is marked for nothing."""
    with schema_context("acme"):
        at_rest()
        token = ApiToken.objects.filter(revoked_at__isnull=True).exclude(user__username="alice").first()
        assert token is not None
        ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now() - timedelta(days=31))
    with schema_context("globex"):
        at_rest()
    order = sorted(
        Tenant.objects.filter(status="active")
        .exclude(schema_name="public")
        .values_list("schema_name", flat=True)
    )
    visited = [walk_due(page=1) for _ in order]
    assert visited == [1] * len(order)
    assert walk_due(page=1) == 0  # past the last tenant: the next tick starts again at the first
    assert due.cursor() == ""
    assert marks("token_purge") == {"acme"}
    assert "globex" not in due.marked(due.KINDS)
    assert marks("cycle") == set()

    apps.accounts.tasks.token_purge_expired("acme")  # purged: settled
    assert marks("token_purge") == set()
    with schema_context("acme"):
        assert not ApiToken.objects.filter(pk=token.pk).exists()


def test_the_walk_marks_work_in_play_and_objectives_to_measure(clean: None, world: World) -> None:
    from apps.scheduling.objectives import objective_save

    with schema_context("acme"):
        Task.objects.filter(pk=world.task_a).update(state=TaskState.QUEUED)
        objective_save(
            name="due-p90", policy="research", percentile=90, target_seconds=600, window_seconds=86_400
        )
    due.client().delete(due.key("objectives"))  # as if Redis had lost it
    assert walk_due(page=50) >= 2  # every tenant in one page: the walk starts again at the first
    assert "acme" in marks("cycle")
    assert "acme" in marks("objectives")
    apps.scheduling.tasks.evaluate_objectives("acme")  # measured this hour, and ok: settled
    with schema_context("acme"):
        assert WaitObjective.objects.get(name="due-p90").state == WaitObjective.State.OK
    assert "acme" not in marks("objectives")
    assert "acme" in marks("cycle")  # its objectives are measured each minute its tasks are in play


def test_marks_lost_with_redis_are_found_in_one_walk_for_every_tenant_with_work_in_play(
    clean: None, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis restarted empty: the next walk, whatever its page, marks the cycle of every tenant with tasks
    in play (not only its page's), once; tenants at rest stay unmarked."""
    with schema_context("acme"):
        at_rest()
        Task.objects.filter(pk=world.task_a).update(state=TaskState.QUEUED)
    with schema_context("globex"):
        at_rest()
    due.client().delete(due.KEPT)  # as Redis comes back from a restart without its data
    due.client().set(due.CURSOR, "acme")  # this tick's page is past acme

    with caplog.at_level("WARNING", logger="tenants.tasks"):
        assert walk_due(page=1) == 1
    assert marks("cycle") == {"acme"}
    assert "the marks of periodic work were lost" in caplog.text
    assert due.client().get(due.KEPT) is not None

    due.client().delete(due.key("cycle"))
    due.client().set(due.CURSOR, "acme")
    caplog.clear()
    walk_due(page=1)  # the loss was seen once: from now on, pages as before
    assert marks("cycle") == set()
    assert "were lost" not in caplog.text


def test_marks_of_tenants_gone_or_suspended_are_dropped(clean: None, sent: list[Any]) -> None:
    due.mark(["acme", "no-such-tenant"], "cycle")
    Tenant.objects.filter(schema_name="globex").update(status="suspended")
    due.mark("globex", "cycle")
    try:
        assert for_marked_tenants("scheduling.run_cycle", ["cycle"]) == 1
    finally:
        Tenant.objects.filter(schema_name="globex").update(status="active")
    assert sent == [("scheduling.run_cycle", ("acme",))]
    assert marks("cycle") == {"acme"}


def test_a_metered_tenant_s_mark_follows_its_calls(clean: None, world: World) -> None:
    """Gateway usage rows written by the outbox mark their tenant; metering them all settles it."""
    from gateway.cache import USAGE_OUTBOX, UsageRow, sync_redis

    row = UsageRow(
        request_id="due-call-1", at=timezone.now(), user_id=world.users["bob"], username="bob",
        project_id=None, project_name="", token_prefix="", agent="", endpoint="chat.completions",
        model="demo-echo", deployment="echo", tokens_in=3, tokens_out=4, cost_nano_usd=10, status="ok",
        duration_ms=5,
    )  # fmt: skip
    sync_redis().rpush(USAGE_OUTBOX, row.to_json("acme"))
    assert gateway.tasks.drain_usage_outbox() == 1
    assert marks("gateway_calls") == {"acme"}
    gateway.tasks.meter_calls("acme")
    assert marks("gateway_calls") == set()


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown kind of periodic work 'everything'"):
        due.key("everything")
