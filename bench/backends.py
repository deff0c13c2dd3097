"""The databases a benchmark runs the service on: the embedded default (SQLite in the service's var dir)
or a fresh PostgreSQL database with a Redis db of its own, dropped and flushed afterwards. Shared by
bench.migration, bench.agent_cpu and bench.service."""
from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

POSTGRES_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_SERVER = "redis://127.0.0.1:6379"


@contextlib.contextmanager
def backend(kind: str, redis_db: int) -> Iterator[dict[str, str]]:
    """Environment for one database kind; a PostgreSQL database and Redis db of the bench's own."""
    if kind == "sqlite":
        yield {}
        return
    if kind != "postgresql":
        raise SystemExit(f"unknown --db {kind!r} (sqlite or postgresql)")
    import psycopg
    import redis

    name = f"wz_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    queue = redis.Redis.from_url(f"{REDIS_SERVER}/{redis_db}")
    if queue.dbsize():  # not ours to flush afterwards: refuse rather than lose someone's data
        raise SystemExit(f"Redis db {redis_db} is not empty; pick another with --redis-db")
    with psycopg.connect(POSTGRES_SERVER, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield {"DATABASE_URL": f"postgresql://postgres@127.0.0.1:5432/{name}",
               "REDIS_URL": f"{REDIS_SERVER}/{redis_db}", "WHALEZEN_QUEUE": name}
    finally:
        with psycopg.connect(POSTGRES_SERVER, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        queue.flushdb()
        queue.close()
