"""What periodic work costs when most tenants are at rest: beat's entries sent only to tenants marked as
having work due (tenants/due.py), beside the fan-out of one task per tenant per tick it replaced.

On a scratch Klique (Django in this process), it makes tenants: a few through `tenant_create` with every
migration run on the new schema, some as copies of one of those schemas by django-tenants' `clone_schema`,
and the rest through `tenant_create` as it is, replaying the schema template (tenants/template.py),
reporting each way's creation p50. 1% of them are active: each simulated minute an
event marks them (as a submission would) and their work runs. Then one simulated minute of beat, both
ways, with every task it sends run at once in this process (the worker's share), for the whole set and
for 100 tenants: CPU seconds per minute. Periods above a minute count pro rata (an hourly entry is 1/60).

Prints a table and `ratio: <marked CPU s/min> / <fan-out CPU s/min>` at the larger size.
Usage: .venv/bin/python bench/tenants_at_rest.py [--tenants 500] [--small 100] [--active-share 0.01]
(a tenant takes about 0.4 s to make from the template on a machine of this kind, and the fan-out about
0.1 s of CPU per tenant and minute: --tenants 10000 --processes 2 runs for about an hour, and its scratch
database takes about 35 GB, 3.5 MB a tenant schema, until it is dropped at the end.)
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from scratch import scratch_django

# (task, its kinds of due work, period in seconds): beat's schedule (config/settings/base.py)
ENTRIES = [
    ("scheduling.run_cycle", ["cycle"], 30.0),
    ("metering.gateway_calls", ["gateway_calls"], 15.0),
    ("scheduling.objectives", ["cycle", "objectives"], 60.0),
    ("metering.running_gpus", ["cycle"], 300.0),
    ("metering.storage", ["storage"], 3600.0),
    ("accounts.token_purge_expired", ["token_purge"], 600.0),
]
OLD_PERIODS = {"accounts.token_purge_expired": 3600.0}  # the fan-out purged hourly
WALK_PERIOD = 60.0


def make_tenants(
    count: int, migrated: int, cloned: int, processes: int = 1
) -> tuple[list[str], dict[str, float]]:
    """`migrated` tenants through `tenant_create` with the schema template off (every migration run on the
    new schema), `cloned` more as copies of the first one's schema by django-tenants' clone_schema, and the
    rest through `tenant_create` as it is: the schema replayed from the template (tenants/template.py, built
    once, before the timing starts). Each way's creation p50 (s).

    clone_schema asks PostgreSQL's catalog about every relation as it copies, and slows as the catalog
    grows (seconds a schema past a few hundred tenants)."""
    from django.conf import settings
    from django.db import connection, connections
    from django_tenants.clone import CloneSchema
    from django_tenants.utils import get_public_schema_name, schema_context

    from apps.provider.services import tenant_create
    from tenants import template
    from tenants.models import Domain, Tenant

    names: list[str] = []
    took: dict[str, list[float]] = {"migrated": [], "clone_schema": [], "template": []}
    settings.KLIQUE_SCHEMA_TEMPLATE = False
    for index in range(migrated):
        started = time.perf_counter()
        tenant_create(slug=f"rest-m{index:05d}", name="at rest", admin_username="admin")
        took["migrated"].append(time.perf_counter() - started)
        names.append(f"rest_m{index:05d}")
    settings.KLIQUE_SCHEMA_TEMPLATE = True
    if not template.ensure():
        raise SystemExit("the schema template cannot be built here (is pg_dump installed?)")
    cloner = CloneSchema()
    slugs = [f"rest-c{index:05d}" for index in range(count - migrated)]
    for slug in slugs[:cloned]:
        started = time.perf_counter()
        with schema_context(get_public_schema_name()):
            tenant = Tenant(schema_name=slug.replace("-", "_"), slug=slug, name="at rest")
            tenant.auto_create_schema = False
            tenant.save(verbosity=0)
            Domain.objects.create(
                domain=f"{slug}.{settings.KLIQUE_BASE_DOMAIN}", tenant=tenant, is_primary=True
            )
            cloner.clone_schema(names[0], tenant.schema_name, set_connection=False)
            connection.set_schema_to_public()  # type: ignore[attr-defined]
        took["clone_schema"].append(time.perf_counter() - started)
    connections.close_all()  # each creating process opens its own
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for done, seconds in enumerate(pool.imap(_create_from_template, slugs[cloned:], chunksize=8), 1):
            took["template"].append(seconds)
            if done % 500 == 0:
                print(f"  {done + cloned + migrated} tenants", file=sys.stderr)
    names += [slug.replace("-", "_") for slug in slugs]
    return names, {way: statistics.median(spans) for way, spans in took.items() if spans}


def _create_from_template(slug: str) -> float:
    """In a creating process: one tenant through tenant_create (from the template); how long it took."""
    from apps.provider.services import tenant_create

    started = time.perf_counter()
    tenant_create(slug=slug, name="at rest", admin_username="admin")
    return time.perf_counter() - started


def inline_sends() -> Callable[[], int]:
    """Run what is sent at once, in this process (the worker's share of the cost); how many were run."""
    import importlib

    from celery import current_app

    for module in ("apps.scheduling.tasks", "apps.fleet.tasks", "apps.accounts.tasks", "gateway.tasks"):
        importlib.import_module(module)  # the tasks, and their kinds' predicates
    ran = [0]

    def send_task(name: str, args: tuple[Any, ...] = (), **_: Any) -> None:
        current_app.tasks[name].apply(args=args)
        ran[0] += 1

    current_app.send_task = send_task  # type: ignore[method-assign,assignment]
    return lambda: ran[0]


def one_minute(*, marked: bool, only: set[str], active: list[str]) -> tuple[float, int]:
    """CPU seconds of one simulated minute of beat (and the work it sends), and how many tasks ran."""
    from tenants import due, tasks
    from tenants.selectors import tenant_list

    def fan_out(task_name: str) -> None:  # the replaced entry: one task per active tenant
        from celery import current_app

        for schema in (
            tenant_list().filter(status="active", schema_name__in=only).values_list("schema_name", flat=True)
        ):
            current_app.send_task(task_name, args=(schema,))

    count = inline_sends()
    for schema in active:  # their events of the minute
        due.mark(schema, "cycle")
        due.mark(schema, "gateway_calls")
    weights = []
    for task_name, kinds, period in ENTRIES:
        every = period if marked else OLD_PERIODS.get(task_name, period)
        weights.append((task_name, kinds, 60.0 / every))
    spent = 0.0
    for task_name, kinds, per_minute in weights:
        runs = max(1, int(per_minute))
        share = per_minute / runs  # an entry due less than once a minute: its one run, pro rata
        before = time.process_time()
        for _ in range(runs):
            if marked:
                tasks.for_marked_tenants(task_name, kinds)
            else:
                fan_out(task_name)
        spent += (time.process_time() - before) * share
    if marked:
        before = time.process_time()
        tasks.walk_due()
        spent += (time.process_time() - before) * 60.0 / WALK_PERIOD
    return spent, count()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=500)
    parser.add_argument("--small", type=int, default=100, help="the smaller set compared (default 100)")
    parser.add_argument("--active-share", type=float, default=0.01)
    parser.add_argument("--migrated", type=int, default=3, help="tenants made through every migration")
    parser.add_argument("--cloned", type=int, default=10, help="tenants made by clone_schema")
    parser.add_argument(
        "--processes", type=int, default=1, help="processes making tenants from the template at once"
    )
    args = parser.parse_args()
    if args.tenants < args.small or args.small < args.migrated:
        parser.error("--tenants >= --small >= --migrated")

    with scratch_django(redis_db=12):
        import logging

        from django.conf import settings

        logging.getLogger("celery").setLevel(logging.WARNING)  # a line per task run would be the cost

        from tenants import due

        client = due.client()
        client.delete(*[due.key(kind) for kind in due.KINDS], due.CURSOR)
        print(
            f"making {args.tenants} tenants ({args.migrated} migrated, {args.cloned} by clone_schema, "
            "the rest from the schema template)...",
            file=sys.stderr,
        )
        made = time.perf_counter()
        names, creation = make_tenants(args.tenants, args.migrated, args.cloned, args.processes)
        print(f"made in {time.perf_counter() - made:.0f} s", file=sys.stderr)
        rows = []
        for size in (args.small, args.tenants):
            settings.KLIQUE_DUE_WALK_PAGE = max(1, round(size / 50))  # one sweep in 50 minutes
            only = set(names[:size])
            active = names[: max(1, round(size * args.active_share))]
            client.delete(*[due.key(kind) for kind in due.KINDS], due.CURSOR)
            one_minute(marked=True, only=only, active=active)  # warm: the first pass settles the marks
            marked_cpu, marked_runs = one_minute(marked=True, only=only, active=active)
            fan_cpu, fan_runs = one_minute(marked=False, only=only, active=active)
            rows.append((size, len(active), marked_cpu, marked_runs, fan_cpu, fan_runs))

    ways = ", ".join(f"{way} {seconds * 1000:.0f} ms" for way, seconds in creation.items())
    print(f"tenant creation p50: {ways}")
    share = f"{args.active_share:.0%} active"
    print(f"one minute of beat and the work it sends, CPU s (this process: beat and worker), {share}")
    print(f"{'tenants':>8}{'active':>8}{'marked CPU s':>14}{'tasks':>8}{'fan-out CPU s':>15}{'tasks':>8}")
    for size, active_count, marked_cpu, marked_runs, fan_cpu, fan_runs in rows:
        print(f"{size:>8}{active_count:>8}{marked_cpu:>14.2f}{marked_runs:>8}{fan_cpu:>15.2f}{fan_runs:>8}")
    small, large = rows[0], rows[-1]
    print(
        f"growth {small[0]} -> {large[0]} tenants: marked x{large[2] / max(small[2], 1e-9):.1f}, "
        f"fan-out x{large[4] / max(small[4], 1e-9):.1f}"
    )
    print(f"ratio: {large[2] / large[4]:.3f} ({large[2]:.2f} / {large[4]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
