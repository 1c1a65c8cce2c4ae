"""Beat's entry points that send a tenant task to tenants: to those marked as having that work due
(tenants.due), to every tenant (for_each_tenant, kept for operators), and the walk that finds what no mark
announced."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from celery import current_app, shared_task
from django.conf import settings
from django_tenants.utils import tenant_context

from tenants import due
from tenants.selectors import tenant_list

logger = logging.getLogger(__name__)


@shared_task(name="tenants.for_each_tenant")
def for_each_tenant(task_name: str) -> int:
    """Send `task_name(schema_name)` once per active tenant; returns how many were sent. Safe to repeat:
    the tasks it sends are idempotent. Not retried: beat sends it again on its next tick."""
    schemas = list(tenant_list().filter(status="active").values_list("schema_name", flat=True))
    for schema_name in schemas:
        current_app.send_task(task_name, args=(schema_name,))
    return len(schemas)


@shared_task(name="tenants.for_marked_tenants")
def for_marked_tenants(task_name: str, kinds: Iterable[str]) -> int:
    """Send `task_name(schema_name)` to each active tenant marked for any of `kinds`; marks of tenants
    gone or suspended are dropped. Returns how many were sent. Nothing marked: one Redis read, no query."""
    kinds = list(kinds)
    names = due.marked(kinds)
    if not names:
        return 0
    active = set(
        tenant_list().filter(status="active", schema_name__in=names).values_list("schema_name", flat=True)
    )
    if gone := names - active:
        for kind in kinds:
            due.client().srem(due.key(kind), *gone)
    for schema_name in sorted(active):
        current_app.send_task(task_name, args=(schema_name,))
    return len(active)


def _remark_cycles() -> None:
    """The marks are gone (Redis restarted empty): mark now every tenant with work in play, so that its
    queued tasks, leases and lost agents are seen to within a tick, not within a whole sweep."""
    in_play = []
    for tenant in tenant_list().filter(status="active").order_by("schema_name").iterator(chunk_size=500):
        with tenant_context(tenant):
            if due.due_here(["cycle"]):
                in_play.append(tenant.schema_name)
    due.mark(in_play, "cycle")
    logger.warning(
        "the marks of periodic work were lost (Redis restarted without its data); %d of the tenants have "
        "work in play and are marked for a scheduling cycle",
        len(in_play),
    )


@shared_task(name="tenants.walk_due")
def walk_due(page: int | None = None) -> int:
    """Visit the next page of tenants (by schema name, wrapping round) and mark, in each, the kinds of
    periodic work its predicates say are due. Returns how many tenants were visited."""
    size = page or settings.KLIQUE_DUE_WALK_PAGE
    client = due.client()
    if due.lost():
        _remark_cycles()
    cursor = due.cursor()
    tenants = list(
        tenant_list().filter(status="active", schema_name__gt=cursor).order_by("schema_name")[:size]
    )
    found: dict[str, list[str]] = {}
    for tenant in tenants:
        with tenant_context(tenant):
            for kind in due.due_here():
                found.setdefault(kind, []).append(tenant.schema_name)
    for kind, names in found.items():
        due.mark(names, kind)
    client.set(due.CURSOR, tenants[-1].schema_name if len(tenants) == size else "")
    return len(tenants)
