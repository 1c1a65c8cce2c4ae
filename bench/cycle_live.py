"""The control plane's scheduling cycle at a deep queue: `run_cycle` on a tenant in PostgreSQL with 100,000
queued and 10,000 running tasks, read and decided in full each time, beside the same tenant kept in the
worker between cycles (apps/scheduling/incremental.py), where a cycle reads only the rows changed since the
last one and decides only the queues they could move.

On a scratch Klique (Django in this process): a tenant with 1,000 pools of 64 GPUs, a profile per pool (it
and the next), 100 policies and 1,000 compute resources (the shape of bench/scheduler_cycle.py's tenant).
The tasks are written straight into its table (1, 2 or 4 GPUs each, spread over the compute resources;
the running ones fill about half of the pools). First, cycles until one moves nothing (the first places
what fits and writes every other task's reason; its time is printed). Then, at rest, full cycles
(`KLIQUE_CYCLE_FULL_SECONDS=0`) and kept cycles, each after 5 arrivals (through `tasks_submit`) and 5
finishes (rows set completed): the median of each.

Prints both and `ratio: <kept ms> / <full ms>`.
Usage: .venv/bin/python bench/cycle_live.py [--queued 100000] [--running 10000] [--repeat 5] [--profile]
                                            [--pools 1000] [--resources 1000] [--pool-gpus 64]
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from scratch import scratch_django


def document(pools: int, resources: int, pool_gpus: int) -> dict[str, Any]:
    """Pools, a profile per pool (it and the next), and a policy per ten compute resources."""
    day = 86_400
    return {
        "pools": [
            {"name": f"pool-{i}", "environment": "baremetal", "capacity_gpus": pool_gpus,
             "heartbeat_timeout_seconds": day}
            for i in range(pools)
        ],
        "profiles": [
            {"name": f"profile-{i}", "display_name": f"profile {i}", "gpus": str(2 ** (i % 3)),
             "pools": [{"pool": f"pool-{i}"}, {"pool": f"pool-{(i + 1) % pools}"}]}
            for i in range(pools)
        ],
        "policies": [
            {"name": f"policy-{p}", "group": "research", "reservation_gpus": "0", "limit_gpus": "100000",
             "compute_resources": [
                 {"profile": f"profile-{(p * 10 + r) % pools}", "name": f"resource-{p}-{r}",
                  "queuing_priority": r % 3}
                 for r in range(10)
             ]}
            for p in range(resources // 10)
        ],
    }  # fmt: skip


def fill(tenant: Any, user: Any, arguments: argparse.Namespace, rng: random.Random) -> list[Any]:
    """The tenant's configuration, online, and its tasks; returns its compute resources."""
    from django.db import connection
    from django.utils import timezone

    from apps.configuration.services import draft_provision, draft_save
    from apps.resources.models import ComputeResource, Pool
    from apps.scheduling.models import Task, TaskState

    shape = document(arguments.pools, arguments.resources, arguments.pool_gpus)
    draft_save(tenant=tenant, user=user, document=shape)
    draft_provision(tenant=tenant, user=user)
    Pool.objects.update(last_heartbeat_at=timezone.now(), heartbeat_timeout_seconds=86_400)
    resources = list(ComputeResource.objects.filter(name__startswith="resource-").select_related("profile"))
    first_pool = {
        resource.pk: resource.profile.pool_order.order_by("position").first().pool_id  # type: ignore[union-attr]
        for resource in resources
    }
    with connection.cursor() as cursor:
        for state, count in ((TaskState.RUNNING, arguments.running), (TaskState.QUEUED, arguments.queued)):
            chosen = rng.choices(resources, k=count)
            cursor.execute(
                f"""INSERT INTO {Task._meta.db_table}
                    (id, name, compute_resource_id, compute_resource_name, submitter_id, size_units, nodes,
                     sharing, priority, submitted_by_agent, idempotency_key, spec, state, reason_code, reason,
                     attempts, max_attempts, submitted_at, queued_at, pool_id, placed_at, started_at)
                    SELECT gen_random_uuid(), '', r.id, r.name, %s, r.size, 1, 'whole', 0, '', '', '{{}}',
                           %s, '', '', 0, 3, now() - r.age * interval '1 day',
                           now() - r.age * interval '1 day',
                           r.pool, CASE WHEN r.pool IS NULL THEN NULL ELSE now() END,
                           CASE WHEN r.pool IS NULL THEN NULL ELSE now() END
                      FROM unnest(%s::uuid[], %s::text[], %s::int[], %s::float8[], %s::uuid[])
                           AS r(id, name, size, age, pool)""",
                [
                    user.pk,
                    state,
                    [resource.pk for resource in chosen],
                    [resource.name for resource in chosen],
                    [resource.profile.size_units for resource in chosen],
                    [rng.random() for _ in chosen],
                    [first_pool[resource.pk] if state == TaskState.RUNNING else None for resource in chosen],
                ],
            )
        cursor.execute(f"ANALYZE {Task._meta.db_table}")  # as autovacuum does after a load this size
    return resources


def measure(tenant: Any, user: Any, resources: list[Any], arguments: argparse.Namespace) -> dict[str, Any]:
    """The first cycle's time, the cycles to rest, and the full and kept cycles' times."""
    from django.conf import settings
    from django.utils import timezone

    from apps.scheduling import incremental
    from apps.scheduling.cycle import run_cycle
    from apps.scheduling.models import Task, TaskState
    from apps.scheduling.services import TaskRequest, tasks_submit

    rng = random.Random(2)

    def cycle() -> float:
        started = time.perf_counter()
        run_cycle(tenant)
        return (time.perf_counter() - started) * 1000

    def events() -> None:
        holding = Task.objects.filter(state__in=(TaskState.PLACED, TaskState.RUNNING)).order_by("?")
        ended = list(holding.values_list("pk", flat=True)[:5])
        Task.objects.filter(pk__in=ended).update(state=TaskState.COMPLETED, ended_at=timezone.now())
        requests = [TaskRequest(compute_resource=rng.choice(resources).name) for _ in range(5)]
        tasks_submit(tenant=tenant, user=user, requests=requests)

    settings.KLIQUE_CYCLE_INCREMENTAL_FROM = 0
    settings.KLIQUE_CYCLE_FULL_SECONDS = 0
    figures: dict[str, Any] = {"first": cycle(), "settles": 1, "full": [], "kept": []}
    while run_cycle(tenant).placed and figures["settles"] < 20:
        figures["settles"] += 1
    for _ in range(arguments.repeat):
        events()
        figures["full"].append(cycle())
    settings.KLIQUE_CYCLE_FULL_SECONDS = 3600
    incremental.forget()
    cycle()  # reads everything, and keeps the tenant
    for _ in range(arguments.repeat):
        events()
        figures["kept"].append(cycle())
    if arguments.profile:
        import cProfile
        import pstats

        events()
        profile = cProfile.Profile()
        profile.runcall(cycle)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    figures["queued"] = Task.objects.filter(state=TaskState.QUEUED).count()
    figures["running"] = Task.objects.filter(state__in=(TaskState.PLACED, TaskState.RUNNING)).count()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--running", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pools", type=int, default=1000)
    parser.add_argument("--resources", type=int, default=1000, help="compute resources (a multiple of 10)")
    parser.add_argument("--pool-gpus", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries of a kept cycle")
    arguments = parser.parse_args()

    with scratch_django(redis_db=13):
        from django_tenants.utils import schema_context

        from apps.accounts.models import User
        from tenants.models import Tenant

        tenant = Tenant.objects.get(slug="demo")
        tenant.gpu_share = None  # a share of the whole plane would bind every queue at each finish
        tenant.save(update_fields=["gpu_share"])
        with schema_context(tenant.schema_name):
            alice = User.objects.get(username="alice")
            resources = fill(tenant, alice, arguments, random.Random(1))
            figures = measure(tenant, alice, resources, arguments)

    full_ms, kept_ms = statistics.median(figures["full"]), statistics.median(figures["kept"])
    print(
        f"tenant: {figures['queued']:,} queued, {figures['running']:,} placed or running; "
        f"{arguments.pools} pools of {arguments.pool_gpus} GPUs, {arguments.resources} compute resources"
    )
    print(f"first cycle: {figures['first']:.0f} ms; at rest after {figures['settles']} cycles")
    print(f"{'a cycle after 5 arrivals and 5 finishes':<44} {'median ms':>10}  runs")
    runs = ", ".join(f"{ms:.0f}" for ms in figures["full"])
    print(f"{'full (read and decide everything)':<44} {full_ms:>10.1f}  {runs}")
    runs = ", ".join(f"{ms:.1f}" for ms in figures["kept"])
    print(f"{'kept (rows changed since, queues moved)':<44} {kept_ms:>10.1f}  {runs}")
    queued = figures["queued"]
    print(f"ratio: {kept_ms / full_ms:.3f} ({kept_ms:.1f} ms / {full_ms:.1f} ms at {queued:,} queued)")


if __name__ == "__main__":
    main()
