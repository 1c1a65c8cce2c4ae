"""How fast the usage ledger takes events, beside a raw PostgreSQL COPY of the same rows.

On a fresh database with the demo tenant, in one process and one run:

- baseline: the ledger rows of N GPU segments, already built in memory, copied with `COPY ... FROM
  STDIN` into a table shaped like the ledger (`LIKE metering_ledgerevent INCLUDING ALL`: the same columns
  and primary key), in one transaction;
- Klique: `apps.metering.ledger.ingest` of the same N events, from the events as a source sends them:
  each checked against the tenant (user, project, pool, times, exact GPU share), priced from the price
  book, deduplicated by event id (`ON CONFLICT DO NOTHING`), with the hourly and daily rollups and the
  provider's per-tenant totals kept in the same statement.

Then the same N events again, all duplicates (a replay), for the record. Prints events per second of each
and `ratio: <Klique's rate> / <COPY's rate>` (the target is at least 0.5).

Usage: .venv/bin/python bench/metering_ingest.py [--events 200000]
Needs PostgreSQL and Redis on 127.0.0.1 (as `make test` does).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from datetime import UTC, datetime, timedelta

from scratch import scratch_django


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    args = parser.parse_args()
    with scratch_django(redis_db=13) as demo:
        return measure(args.events, demo["tenant"])


def measure(count: int, schema: str) -> int:
    from django.db import connection, transaction
    from django_tenants.utils import schema_context

    from apps.metering import ledger
    from apps.metering.ledger import Directory, Event, _row

    ingest = ledger.ingest
    from apps.metering.models import PriceBook

    rng = random.Random(5)
    now = datetime.now(UTC)
    start = now - timedelta(days=25)
    shares = ["1", "2", "4", "8", "0.25", "0.5", "1/7", "3/7"]
    users = ["alice", "bob"]
    events = []
    for index in range(count):
        begin = start + timedelta(seconds=index * 7)
        events.append(
            Event(
                event_id=f"run-{index}",
                kind="gpu",
                started_at=begin,
                ended_at=begin + timedelta(seconds=rng.randrange(60, 86_400)),
                user=rng.choice(users),
                project="vision",
                group="research",
                pool="lab-h100",
                compute_resource="Research: 4 GPUs",
                gpus=rng.choice(shares),
                source="scheduler",
            )
        )
    with schema_context(schema):
        PriceBook.objects.update_or_create(pk=1, defaults={"gpu_hour": {"H100": "2.50", "*": "1.00"}})
        directory = Directory(now, events)
        rows = [_row(event, directory) for event in events]
        from apps.metering.ledger import COLUMNS

        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE bench_raw (LIKE metering_ledgerevent INCLUDING ALL)")
        began = time.perf_counter()
        statement = f"COPY bench_raw ({', '.join(COLUMNS)}) FROM STDIN"
        with transaction.atomic(), connection.cursor() as cursor, cursor.cursor.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)
        copy_seconds = time.perf_counter() - began

        began = time.perf_counter()
        report = ingest(events, now=now)
        ingest_seconds = time.perf_counter() - began
        assert report.accepted == count, report
        began = time.perf_counter()
        replay = ingest(events, now=now)
        replay_seconds = time.perf_counter() - began
        assert (replay.accepted, replay.duplicates) == (0, count), replay

    copy_rate, ingest_rate, replay_rate = count / copy_seconds, count / ingest_seconds, count / replay_seconds
    print(f"{count:,} GPU-segment events, one process, one transaction each")
    print(f"{'':44}{'seconds':>9}{'events/s':>11}")
    print(f"{'raw COPY of the built rows':44}{copy_seconds:>9.2f}{copy_rate:>11,.0f}")
    print(f"{'Klique ingest (check, price, dedupe, rollups)':44}{ingest_seconds:>9.2f}{ingest_rate:>11,.0f}")
    print(f"{'Klique ingest of the same events again':44}{replay_seconds:>9.2f}{replay_rate:>11,.0f}")
    print(f"ratio: {ingest_rate / copy_rate:.3f} ({ingest_rate:,.0f} / {copy_rate:,.0f} events per second)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
