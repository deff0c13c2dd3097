"""bench.billing: how long a month's statement and a `group_by=day` cost report take for a team with
100,000 usage records (issue 13's goal: under 1 s on PostgreSQL).

    .venv/bin/python -m bench.billing --json [--db postgresql|sqlite] [--records 100000] [--repeat 5]

A fresh database (PostgreSQL: a database of its own on 127.0.0.1:5432, dropped afterwards; SQLite: a
temporary file), migrated, with one team whose month holds `--records` usage records: 5,000 allocations
(a mix of GPU models, providers, pools, users, spot and on-demand, 5% idle lines) each with one record
per day they ran. Timed through the real selectors, as the API calls them: `statement_build` (one line
item per allocation, live part included) and `cost_report(group_by=["day"])`, plus
`group_by=["user","gpu_model"]` and the month-to-date spend the scheduler reads per cycle. Median of
`--repeat` runs after one warm-up. The last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from datetime import date, datetime, timedelta, timezone as dt_timezone
from decimal import ROUND_HALF_EVEN, Decimal

POSTGRES_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
MONTH = "2026-10"


@contextmanager
def database(kind: str):
    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["WHALEZEN_VAR_DIR"] = tmp
            os.environ.pop("DATABASE_URL", None)
            yield "sqlite"
        return
    import psycopg

    name = f"wz_bench_billing_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(POSTGRES_SERVER, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    os.environ["DATABASE_URL"] = f"postgresql://postgres@127.0.0.1:5432/{name}"
    try:
        yield "postgresql"
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(POSTGRES_SERVER, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def seed(records: int) -> tuple[object, float]:
    from django.contrib.auth import get_user_model

    from broker.billing.models import UsageRecord
    from broker.tenancy.models import Tenant

    t0 = time.perf_counter()
    team = Tenant.objects.create(slug="bench", name="Bench")
    other = Tenant.objects.create(slug="other", name="Other")
    get_user_model().objects.create_user(username="bench-admin")
    models = [("A100-80GB", "onprem", "platform/shared-a100", "dc1", Decimal("2.50"), False),
              ("H100-80GB", "aws", "bench/aws-use1", "us-east-1", Decimal("12.2900"), False),
              ("L4", "gcp", "bench/gcp-usc1", "us-central1", Decimal("0.2190"), True),
              ("A10G", "aws", "bench/aws-use1", "us-east-1", Decimal("2.0300"), False)]
    allocations = 5000
    days_each = max(1, records // allocations)
    first = datetime(2026, 10, 1, tzinfo=dt_timezone.utc)
    rows = []
    n = 0
    for a in range(allocations):
        model, provider, pool, region, rate, spot = models[a % len(models)]
        idle = a % 20 == 0
        begin_day = a % max(1, 31 - days_each)
        for d in range(days_each):
            if n >= records:
                break
            day = (first + timedelta(days=begin_day + d)).date()
            start = datetime.combine(day, datetime.min.time(), tzinfo=dt_timezone.utc)
            seconds = 86400 if d < days_each - 1 else 3600 * (1 + a % 23)
            gpus = Decimal(1 + a % 8) if not idle else Decimal("2.500")
            gpu_seconds = gpus * seconds
            rows.append(UsageRecord(
                key=f"{'idle' if idle else 'alloc'}:{a}:{day.isoformat()}", kind="idle" if idle else "usage",
                tenant=team, month=MONTH, day=day, job_id=None if idle else 10_000 + a,
                job_name="__idle__" if idle else f"job-{a}", user="__idle__" if idle else f"user{a % 17}",
                allocation_id=None if idle else a, instance_id=a if idle else None, node=f"node-{a % 300}",
                gpu_model=model, provider=provider, pool=pool, region=region, spot=spot, start=start,
                end=start + timedelta(seconds=seconds), seconds=seconds, gpus=gpus, gpu_seconds=gpu_seconds,
                rate_usd_per_gpu_hour=rate,
                amount_usd=(gpu_seconds * rate / 3600).quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN),
                avg_gpu_utilisation=None if idle else float(40 + a % 60)))
            n += 1
            if len(rows) >= 5000:
                UsageRecord.objects.bulk_create(rows)
                rows = []
    # Another team's month beside it (the queries must not read it).
    for i in range(2000):
        day = (first + timedelta(days=i % 31)).date()
        start = datetime.combine(day, datetime.min.time(), tzinfo=dt_timezone.utc)
        rows.append(UsageRecord(key=f"alloc:o{i}:{day}", kind="usage", tenant=other, month=MONTH, day=day,
                                job_id=i, job_name="x", user="o", allocation_id=900_000 + i, node="n",
                                gpu_model="T4", provider="onprem", pool="other/onprem", region="", spot=False,
                                start=start, end=start + timedelta(hours=1), seconds=3600, gpus=Decimal(1),
                                gpu_seconds=Decimal(3600), rate_usd_per_gpu_hour=Decimal(1),
                                amount_usd=Decimal("1.00")))
    UsageRecord.objects.bulk_create(rows)
    from django.db import connection

    if connection.vendor == "postgresql":  # what autovacuum would have done by then: planner statistics
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE billing_usagerecord")
    return team, time.perf_counter() - t0


def timed(fn, repeat: int) -> tuple[float, object]:
    result = fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="unused (no plot); accepted like the other benchmarks")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "broker.settings")
    with database(args.db) as kind:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from broker.billing.models import UsageRecord
        from broker.billing.selectors import cost_report, month_to_date_spend
        from broker.billing.statements import statement_build

        team, seed_s = seed(args.records)
        count = UsageRecord.objects.filter(tenant=team, month=MONTH).count()
        now = datetime(2026, 10, 31, 23, 0, tzinfo=dt_timezone.utc)
        statement_s, statement = timed(lambda: statement_build(tenant=team, month=MONTH, now=now), args.repeat)
        day_s, day_rows = timed(lambda: cost_report(tenant=team, start=date(2026, 10, 1), end=date(2026, 11, 1),
                                                    group_by=["day"], now=now), args.repeat)
        combo_s, combo_rows = timed(lambda: cost_report(tenant=team, start=date(2026, 10, 1),
                                                        end=date(2026, 11, 1), group_by=["user", "gpu_model"],
                                                        now=now), args.repeat)
        spend_s, spend = timed(lambda: month_to_date_spend(tenant=team, now=now), args.repeat)
        day_total = sum(Decimal(r["cost"]) for r in day_rows)
        figures = {
            "bench": "billing", "db": kind, "records": count, "seed_s": round(seed_s, 2), "repeat": args.repeat,
            "statement_s": round(statement_s, 4), "statement_lines": len(statement["lines"]),
            "statement_total_usd": statement["totals"]["total_usd"],
            "group_by_day_s": round(day_s, 4), "group_by_day_rows": len(day_rows),
            "group_by_user_gpu_model_s": round(combo_s, 4), "group_by_user_gpu_model_rows": len(combo_rows),
            "month_to_date_spend_s": round(spend_s, 4), "month_to_date_spend_usd": str(spend),
            "totals_agree": str(day_total) == statement["totals"]["total_usd"] == str(spend),
            "goal_s": 1.0,
        }
    if not args.json:
        for key, value in figures.items():
            print(f"{key:32} {value}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
