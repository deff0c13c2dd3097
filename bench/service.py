"""The whole service measured as users meet it (issue 12): scheduling cycle, submissions, reads, agents.

    .venv/bin/python -m bench.service [--json] [--db sqlite,postgresql] [--parts cycle,submissions,reads,agents]
                                      [--quick]

Parts (each per database kind of --db unless said otherwise):

- cycle: the 1,213 Alibaba GPU nodes (`openb_node_list_gpu_node.csv`) registered as real Node/Gpu rows
  through `node_create_simulated`, in one on-prem pool of a `platform` tenant granted (`pool_share`) to
  four teams, plus a cloud-sim pool as the demo has (the `local` provider's three shapes, at most 2
  instances; its offers need no live provider, and a launch only records the instance: nothing is
  provisioned, as no worker runs), then N pending jobs sampled (seeded, with replacement) from the GPU
  pods of `openb_pod_list_default.csv`, submitted through `job_submit` round-robin for the four teams.
  `scheduling_cycle_run` is timed in this process on the real database (a fresh PostgreSQL database, or
  SQLite in a temporary var dir), then once more with nothing new (the idle cycle: the same jobs still
  pending for the same reasons; after a fresh start that is whatever the first cycle could not place).
  After the largest size, `--saturated` (5,000) measures the idle cycle on the full cluster: what fits
  placed (more jobs submitted while fewer than 5,000 are left pending), 5,000 jobs left pending (the newest
  beyond them cancelled), nothing new. Before each repetition the state is reset to what the seeding left: every
  row a cycle added (allocations, slices, events, cloud instances, moves, fair-share usage, ...) deleted,
  every job PENDING again with its submission reason; node epochs are left as they are.
  Phases come from `CycleOutcome.phases` when the broker gives them, else from timing the cycle's own
  steps (cloud_offers + component_snapshot = snapshot, schedule = solve, plan_commit less its pending
  reasons = commit, job_set_pending_reason inside plan_commit = reasons); `phases_from` says which.
  Alibaba models map to the catalogue by alias (V100M16 -> V100-16GB, V100M32 -> V100-32GB, T4, P100,
  A10); G1/G2/G3, which the trace does not name, map to V100-32GB (32 GB, as bench.scale counts them).
- submissions: POST /api/v1/jobs/ from a bounded thread pool on loopback at concurrency 1, 8 and 32 against
  the server `make run` starts (`serve --no-agents`: gunicorn gthread, 2 processes x 16 threads, plus Celery
  worker and beat) on
  SQLite, and against docker-compose.yml's service (gunicorn --workers 3, Celery worker and beat,
  production settings) on PostgreSQL + Redis. One server per database; the levels run one after another,
  so later levels see the earlier levels' jobs pending (the worker schedules them on the 4 demo nodes).
  Each level also reports the CPU each process of the service spent per answered request (from /proc), the
  load generator's own, and the cores the service used: far steadier than requests/s on a shared machine.
- reads: 100,000 jobs bulk-inserted for the demo tenant `acme` (bulk_create in the states a real database
  holds: mostly SUCCEEDED, some FAILED, CANCELLED and PENDING; on PostgreSQL then VACUUM ANALYZE, as
  autovacuum would within a minute), then GET /api/v1/jobs/ (first page) and
  GET /api/v1/jobs/?state=FAILED through the web server alone, sequentially: p50/p99; also a page halfway
  through the list (`?page=1000` of 2,000), what an offset costs.
- agents (SQLite, the default service): idle agent CPU as bench.agent_cpu measures it (`make run`'s seven
  demo agents, from /proc), and 1,000 simulated nodes registered through the API with a join token, then
  heartbeating every 5 s (bodies built by the agent's own code) from a bounded thread pool: heartbeat
  latency p50/p99, how late the generator sent, and the broker's CPU (web + worker + beat processes, from
  /proc) in percent of one core. The registration throttle is lifted for the bench (1,000 registrations
  from one address).

The last line with --json is one JSON object: {"cycle": [...], "submissions": [...], "reads": [...],
"agent": {...}} in the shape issue 12 gives, with extra keys (runs, placed, idle pending, ...).
This machine has 2 cores and is shared: read every figure as a median on a noisy machine.
"""
from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from bench.backends import backend

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
ALIBABA = DATA / "alibaba-gpu-v2023"
NODES_CSV = ALIBABA / "openb_node_list_gpu_node.csv"
PODS_CSV = ALIBABA / "openb_pod_list_default.csv"

# Alibaba model -> our catalogue (broker/inventory/gpu_catalog.py); G1-G3 are unnamed in the trace.
MODEL_MAP = {"V100M16": "V100-16GB", "V100M32": "V100-32GB", "T4": "T4", "P100": "P100", "A10": "A10",
             "G1": "V100-32GB", "G2": "V100-32GB", "G3": "V100-32GB"}
TEAMS = ("team-a", "team-b", "team-c", "team-d")
PHASES = ("snapshot", "solve", "commit", "reasons")
DURATIONS = (0.5, 1.0, 2.0, 4.0)


# ---------------------------------------------------------------------------------------- pure parts
def median(values: Sequence[float | None], digits: int = 4) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), digits) if known else None


def percentile_ms(seconds: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile of latencies in seconds, in ms."""
    if not seconds:
        return None
    ordered = sorted(seconds)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))
    return round(ordered[index] * 1000, 1)


def pod_spec(index: int, task: Any, duration: float) -> dict[str, Any]:
    """A job spec for one Alibaba pod: its GPUs (or share of one), CPU and memory."""
    resources: dict[str, Any] = {"cpu": task.cpu_milli / 1000}
    if task.num_gpu == 1 and task.gpu_milli < 1000:
        resources["gpu_fraction"] = task.gpu_milli / 1000
    else:
        resources["gpus"] = task.num_gpu
    if task.memory_mib > 0:
        resources["memory_gb"] = round(task.memory_mib / 1024, 3)
    return {"name": f"{task.name}-{index}", "command": ["python", "-c", "pass"], "resources": resources,
            "expected_duration_hours": duration}


def sample_pods(count: int, seed: int = 0, path: Path = PODS_CSV) -> list[tuple[Any, float]]:
    """`count` (pod, expected hours) drawn with replacement from the GPU pods (seeded: the cycle's sizes are
    prefixes of one draw, so each size adds jobs to the same database)."""
    import numpy as np

    from bench.loaders import read_tasks

    gpu_tasks = [t for t in read_tasks(path) if t.num_gpu > 0]
    rng = np.random.default_rng(seed)
    picks = rng.integers(len(gpu_tasks), size=count)
    hours = rng.choice(DURATIONS, size=count)
    return [(gpu_tasks[int(k)], float(h)) for k, h in zip(picks, hours)]


def cycle_entry(db: str, pending: int, nodes: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One size's entry in issue 12's shape (medians over the runs) plus what the runs did."""
    return {
        "db": db, "pending": pending, "nodes": nodes, "scenario": "fresh",
        "median_s": median([r["cycle_s"] for r in runs]),
        "idle_median_s": median([r["idle_s"] for r in runs]),
        "phases": {p: median([r["phases"].get(p) for r in runs]) for p in PHASES},
        "idle_phases": {p: median([r["idle_phases"].get(p) for r in runs]) for p in PHASES},
        "phases_from": runs[0]["phases_from"] if runs else None,
        "runs": len(runs), "max_s": round(max(r["cycle_s"] for r in runs), 4) if runs else None,
        "placed": median([r["placed"] for r in runs], 1), "launched": median([r["launched"] for r in runs], 1),
        "conflicts": median([r["conflicts"] for r in runs], 1),
        "idle_pending": median([r["idle_pending"] for r in runs], 1),
    }


# ----------------------------------------------------------------------- 1. cycle (in-process worker)
class PhaseClock:
    """Times the cycle's steps by wrapping the names broker.scheduler.services calls them by (used only
    when the broker's CycleOutcome carries no `phases`)."""

    WRAPPED = {"cloud_offers": "snapshot", "component_snapshot": "snapshot", "schedule": "solve",
               "plan_commit": "commit", "job_set_pending_reason": "reasons"}

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._originals: dict[str, Any] = {}
        self._depth = 0

    def __enter__(self) -> "PhaseClock":
        from broker.scheduler import services

        for name, phase in self.WRAPPED.items():
            original = getattr(services, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(services, name, self._timed(original, phase))
        return self

    def __exit__(self, *exc: object) -> None:
        from broker.scheduler import services

        for name, original in self._originals.items():
            setattr(services, name, original)

    def _timed(self, function: Any, phase: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started
        return timed

    def phases(self) -> dict[str, float]:
        out = {p: round(self.seconds.get(p, 0.0), 4) for p in PHASES}
        out["commit"] = round(max(0.0, out["commit"] - out["reasons"]), 4)  # reasons are written inside it
        return out


def _timed_cycle(tenant: Any) -> tuple[float, dict[str, float], str, Any]:
    from broker.scheduler.services import scheduling_cycle_run

    profile_dir = os.environ.get("WHALEZEN_BENCH_PROFILE")  # a folder: one cProfile dump per cycle there
    profiler = None
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
    with PhaseClock() as clock:
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        outcome = scheduling_cycle_run(tenant=tenant)
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - started
    if profiler is not None:
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(Path(profile_dir) / f"cycle-{time.time_ns()}.pstats"))
    given = getattr(outcome, "phases", None)
    if given:
        return seconds, {p: round(float(given.get(p, 0.0)), 4) for p in PHASES}, "CycleOutcome.phases", outcome
    return seconds, clock.phases(), "bench timing of the cycle's steps", outcome


def seed_cluster(node_csv: Path = NODES_CSV, *, node_limit: int | None = None) -> dict[str, Any]:
    """The platform tenant's Alibaba pool and cloud-sim pool, granted to the teams; returns the objects."""
    from django.contrib.auth import get_user_model

    from bench.loaders import read_nodes
    from broker.inventory.management.commands.seed_demo import SIM_CLOUD_CONFIG, seed_gpu_models
    from broker.inventory.models import Pool, PoolKind
    from broker.inventory.services import node_create_simulated, pool_share
    from broker.tenancy.models import Role, Tenant
    from broker.tenancy.services import membership_add

    models = seed_gpu_models()
    platform, _ = Tenant.objects.get_or_create(slug="platform", defaults={"name": "Platform"})
    pool, _ = Pool.objects.get_or_create(tenant=platform, name="alibaba",
                                         defaults={"kind": PoolKind.ONPREM, "region": "dc1"})
    cloud, _ = Pool.objects.get_or_create(
        tenant=platform, name="cloud-sim",
        defaults={"kind": PoolKind.LOCAL, "region": "sim-east-1", "max_instances": 2,
                  "provider_config": SIM_CLOUD_CONFIG})
    nodes = read_nodes(node_csv)[:node_limit]
    for n in nodes:
        model = models[MODEL_MAP[n.model]]
        node_create_simulated(pool=pool, name=n.name, gpu_model=model, gpu_count=n.num_gpu,
                              nvlink_island_size=n.num_gpu if model.nvlink else 0, cpu_milli=n.cpu_milli,
                              memory_mb=n.memory_mib)
    User = get_user_model()
    teams, owners = [], []
    for slug in TEAMS:
        team, _ = Tenant.objects.get_or_create(slug=slug, defaults={"name": slug})
        user, _ = User.objects.get_or_create(username=f"{slug}-bench")
        membership_add(tenant=team, user=user, role=Role.MEMBER)
        pool_share(pool=pool, tenant=team)
        pool_share(pool=cloud, tenant=team)
        teams.append(team)
        owners.append(user)
    return {"teams": teams, "owners": owners, "nodes": len(nodes)}


def submit_jobs(seeded: dict[str, Any], pods: list[tuple[Any, float]], start: int) -> None:
    """Submit pods[start:] through job_submit (the API's path less HTTP), round-robin over the teams."""
    from broker.jobs import selectors
    from broker.jobs.services import job_submit
    from broker.jobs.spec import JobSpecSerializer

    catalog = selectors.gpu_catalog()
    teams, owners = seeded["teams"], seeded["owners"]
    for i in range(start, len(pods)):
        task, hours = pods[i]
        spec = JobSpecSerializer(data=pod_spec(i, task, hours), context={"gpu_catalog": catalog})
        spec.is_valid(raise_exception=True)
        k = i % len(teams)
        job_submit(tenant=teams[k], owner=owners[k], validated=spec.validated_data)


def _integer_pk_models() -> list[Any]:
    from django.apps import apps

    return [m for m in apps.get_models()
            if m._meta.pk.get_internal_type() in ("AutoField", "BigAutoField", "SmallAutoField")
            and not m._meta.proxy and m._meta.managed]


class Baseline:
    """What the seeding left: the highest id of every table, so a reset deletes what a cycle added."""

    KEEP = {"scheduler.cyclerecord", "scheduler.cyclelease"}  # the cycles' own bookkeeping

    def __init__(self) -> None:
        from django.db.models import Max

        self.max_pk = {m: (m.objects.aggregate(top=Max("pk"))["top"] or 0) for m in _integer_pk_models()}

    def reset(self) -> None:
        from django.db import transaction
        from django.utils import timezone

        from broker.jobs.models import Job
        from broker.jobs.states import JobState

        with transaction.atomic():
            for model, top in self.max_pk.items():
                if model._meta.label_lower in self.KEEP or model is Job:
                    continue
                extra = model.objects.filter(pk__gt=top)
                if extra.exists():
                    extra.delete()
            Job.objects.update(state=JobState.PENDING, pending_reason_code="NOT_YET_SCHEDULED",
                               pending_reason="Waiting for the next scheduling cycle.", pending_reason_data={},
                               next_attempt_at=timezone.now(), started_at=None, finished_at=None)


def cycle_worker(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs inside a process whose settings point at a migrated, empty database."""
    import django

    django.setup()
    from broker.jobs.models import Job
    from broker.jobs.states import JobState

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    seeded = seed_cluster(Path(opts["nodes_csv"]), node_limit=opts.get("node_limit"))
    say(f"[cycle {opts['db']}] seeded {seeded['nodes']} nodes in {time.perf_counter() - t0:.1f} s")
    sizes = sorted(opts["sizes"])
    pods = sample_pods(max(sizes), opts["seed"], Path(opts["pods_csv"]))
    entries, submitted = [], 0
    for size in sizes:
        t0 = time.perf_counter()
        submit_jobs(seeded, pods[:size], submitted)
        submitted = size
        say(f"[cycle {opts['db']}] {size} jobs submitted ({time.perf_counter() - t0:.1f} s)")
        baseline = Baseline()
        runs: list[dict[str, Any]] = []
        budget_end = time.monotonic() + opts["budget_s"]
        for rep in range(opts["repeat"]):
            baseline.reset()
            seconds, phases, source, outcome = _timed_cycle(seeded["teams"][0])
            idle_s, idle_phases, _, idle = _timed_cycle(seeded["teams"][0])
            run = {"cycle_s": round(seconds, 4), "phases": phases, "phases_from": source,
                   "idle_s": round(idle_s, 4), "idle_phases": idle_phases, "placed": len(outcome.placed),
                   "launched": len(outcome.launched), "conflicts": len(outcome.conflicts),
                   "idle_placed": len(idle.placed),
                   "idle_pending": Job.objects.filter(state=JobState.PENDING).count()}
            runs.append(run)
            say(f"[cycle {opts['db']}] {size} pending, run {rep + 1}: {json.dumps(run)}")
            if time.monotonic() > budget_end and rep + 1 < opts["repeat"]:
                say(f"[cycle {opts['db']}] {size}: time budget spent after {rep + 1} runs")
                break
        entries.append(cycle_entry(opts["db"], size, seeded["nodes"], runs))
        if size == sizes[-1] and opts.get("saturated"):
            entries.append(saturated_idle(opts, seeded, say))
        baseline.reset()
    return entries


def saturated_idle(opts: dict[str, Any], seeded: dict[str, Any], say: Any) -> dict[str, Any]:
    """The idle cycle on a full cluster: after the largest size's last cycle has placed what fits (more jobs
    are submitted and a cycle run again while fewer than `saturated` are left pending, so the cluster is
    full whatever the largest size), the newest pending jobs beyond `saturated` are cancelled, one cycle
    runs (the remaining jobs' reasons settle), then the cycle is timed at least 5 times with nothing new:
    `saturated` jobs pending for the same reasons as last cycle (issue 12: under 200 ms at 5,000)."""
    from broker.jobs.models import Job
    from broker.jobs.states import JobState

    tenant = seeded["teams"][0]
    pending = Job.objects.filter(state=JobState.PENDING)
    submitted = Job.objects.count()
    for _ in range(6):
        short = opts["saturated"] - pending.count()
        if short <= 0:
            break
        extra = short + max(100, short // 10)
        submit_jobs(seeded, sample_pods(submitted + extra, opts["seed"], Path(opts["pods_csv"])), submitted)
        submitted += extra
        _timed_cycle(tenant)  # places what still fits
        say(f"[cycle {opts['db']}] full cluster: {extra} more jobs submitted, {pending.count()} pending")
    excess = pending.count() - opts["saturated"]
    if excess > 0:
        ids = list(pending.order_by("-id").values_list("id", flat=True)[:excess])
        Job.objects.filter(pk__in=ids).update(state=JobState.CANCELLED)
    settle_s, _, _, _ = _timed_cycle(tenant)
    runs = []
    for rep in range(max(opts["repeat"], 5)):  # idle cycles are cheap: always at least 5
        seconds, phases, source, outcome = _timed_cycle(tenant)
        runs.append({"cycle_s": round(settle_s, 4), "phases": {}, "phases_from": source, "idle_s": round(seconds, 4),
                     "idle_phases": phases, "placed": len(outcome.placed), "launched": len(outcome.launched),
                     "conflicts": len(outcome.conflicts), "idle_pending": pending.count()})
        say(f"[cycle {opts['db']}] full cluster, idle run {rep + 1}: {json.dumps(runs[-1])}")
    entry = cycle_entry(opts["db"], runs[0]["idle_pending"] if runs else 0, seeded["nodes"], runs)
    entry.update(scenario="full cluster, nothing new", settle_s=round(settle_s, 4), median_s=None, max_s=None,
                 phases=entry["idle_phases"])
    return entry


def measure_cycle(db: str, args: argparse.Namespace, say: Any) -> list[dict[str, Any]]:
    """Migrate a fresh database of `db` kind and run the cycle worker against it in a child process."""
    opts = {"db": db, "sizes": args.sizes, "repeat": args.repeat, "budget_s": args.cycle_budget, "seed": args.seed,
            "nodes_csv": str(args.nodes), "pods_csv": str(args.pods), "node_limit": args.node_limit,
            "saturated": args.saturated}
    with tempfile.TemporaryDirectory(prefix="wz-bench-svc-") as var, backend(db, args.redis_db) as db_env:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(WHALEZEN_VAR_DIR=var, DJANGO_SETTINGS_MODULE="broker.settings", DJANGO_DEBUG="0",
                   WHALEZEN_TASKS_EAGER="0", **db_env)
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
        done = subprocess.run([sys.executable, "-m", "bench.service", "--cycle-worker", json.dumps(opts)], cwd=ROOT,
                              env=env, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ 2. submissions
def measure_submissions(db: str, args: argparse.Namespace, say: Any) -> list[dict[str, Any]]:
    from bench.procs import data_server_cpu
    from bench.submit_load import fire, production_server, seeded_server, summarize
    from broker.ops.web import WEB_THREADS, WEB_WORKERS

    out = []
    with tempfile.TemporaryDirectory(prefix="wz-bench-svc-sub-") as var, backend(db, args.redis_db) as db_env:
        prepare = _without_cloud_sim if args.no_cloud_sim else None
        if db == "sqlite":
            server_cm = seeded_server(Path(var), worker=True, prepare=prepare)
            name = f"make run (serve: gunicorn gthread {WEB_WORKERS}x{WEB_THREADS} + worker)"
        else:
            server_cm = production_server(Path(var), db_env, prepare=prepare)
            name = "docker-compose (gunicorn --workers 3 + worker)"
        if args.no_cloud_sim:
            name += ", no cloud-sim pools"
        with server_cm as server:
            for concurrency in args.concurrency:
                requests = max(args.min_requests, args.requests_per_thread * concurrency)
                fire(server, requests=concurrency, concurrency=concurrency, timeout_s=60)  # warm, not counted
                cpu_before, generator_before = service_cpu(server), time.process_time()
                servers_before = data_server_cpu()
                answers, seconds = fire(server, requests=requests, concurrency=concurrency, timeout_s=60)
                cpu = cpu_spent(cpu_before, service_cpu(server))
                servers = cpu_spent(servers_before, data_server_cpu())
                generator = time.process_time() - generator_before
                s = summarize(answers, seconds, concurrency)
                entry = {"db": db, "server": name, "cloud_sim": not args.no_cloud_sim, "concurrency": concurrency,
                         "rps": s["requests_per_s"],
                         "p50_ms": s["p50_ms"], "p95_ms": s["p95_ms"], "p99_ms": s["p99_ms"], "errors": s["errors"],
                         "requests": s["requests"], "error_kinds": s["error_kinds"],
                         **cpu_per_request(cpu, generator, len(answers), seconds),
                         # Not in cpu_ms_per_request: the database's and Redis's processes (PostgreSQL only;
                         # SQLite runs inside the service's own processes).
                         "data_server_cpu_ms_per_request": (
                             {k: round(1000 * v / len(answers), 2) for k, v in sorted(servers.items())}
                             if db != "sqlite" and answers else {})}
                say(f"[submissions {db}] {json.dumps(entry)}")
                out.append(entry)
    return out


def _without_cloud_sim(env: dict[str, str]) -> None:
    """Delete the demo's cloud-sim pools (`--no-cloud-sim`): the `local` provider runs each simulated
    instance's agent as processes on this machine, which an instance a real cloud rents does not; the
    difference between the two runs is what those processes take from the service on 2 cores."""
    code = "from broker.inventory.models import Pool; Pool.objects.filter(kind='local').delete()"
    subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)


# ------------------------------------------------------------------------------------------ 3. reads
READ_STATES = (("SUCCEEDED", 0.80), ("FAILED", 0.08), ("CANCELLED", 0.07), ("PENDING", 0.05))


def bulk_jobs(count: int, tenant_slug: str = "acme") -> None:
    """`count` jobs of `tenant_slug` in the states a real database holds, by bulk_create (no events)."""
    import django

    django.setup()
    from datetime import timedelta

    from django.utils import timezone

    from broker.jobs.models import Job
    from broker.tenancy.models import Membership, Tenant

    tenant = Tenant.objects.get(slug=tenant_slug)
    owner = Membership.objects.filter(tenant=tenant).select_related("user").first().user
    now = timezone.now()
    pods = sample_pods(min(count, 5000), seed=1)
    cumulative, edge = [], 0.0
    for state, share in READ_STATES:
        edge += share
        cumulative.append((edge, state))
    batch = []
    for i in range(count):
        task, hours = pods[i % len(pods)]
        state = next(s for e, s in cumulative if (i % 100) / 100 < e)
        spec = pod_spec(i, task, hours)
        done = state != "PENDING"
        batch.append(Job(
            tenant=tenant, owner=owner, name=spec["name"], spec=spec, state=state,
            gpu_count=task.num_gpu, gpu_milli=task.gpu_milli if task.num_gpu == 1 else 1000,
            cpu_milli=task.cpu_milli, memory_mb=task.memory_mib, expected_duration_hours=hours,
            pending_reason_code="" if done else "NO_CAPACITY",
            pending_reason="" if done else "No node has the GPUs free.",
            started_at=now - timedelta(hours=hours) if done else None, finished_at=now if done else None))
        if len(batch) == 2000:
            Job.objects.bulk_create(batch)
            batch = []
    Job.objects.bulk_create(batch)
    from django.db import connection

    if connection.vendor == "postgresql":
        # What autovacuum does within a minute of such an insert (PostgreSQL 13+ vacuums after inserts
        # too, autovacuum_vacuum_insert_threshold): statistics, and the visibility map that lets an
        # index-only scan skip the table.
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE jobs_job")


def _get(base: str, token: str, path: str) -> tuple[int, float]:
    request = urllib.request.Request(f"{base}{path}", headers={"Authorization": f"Bearer {token}"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        status = err.code
    return status, time.perf_counter() - started


def measure_reads(db: str, args: argparse.Namespace, say: Any) -> list[dict[str, Any]]:
    from bench.submit_load import production_server, seeded_server

    def prepare(env: dict[str, str]) -> None:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "bench.service", "--bulk-jobs", str(args.read_jobs)], cwd=ROOT,
                       env=env, check=True)
        say(f"[reads {db}] {args.read_jobs} jobs inserted in {time.perf_counter() - t0:.1f} s")

    out = []
    with tempfile.TemporaryDirectory(prefix="wz-bench-svc-read-") as var, backend(db, args.redis_db) as db_env:
        if db == "sqlite":
            server_cm = seeded_server(Path(var), worker=False, prepare=prepare)
        else:
            server_cm = production_server(Path(var), db_env, worker=False, prepare=prepare)
        with server_cm as server:
            token = server.tokens[0]  # acme's
            deep = max(1, args.read_jobs // 100)  # halfway through the list at 50 a page
            for page, path in (("first", "/api/v1/jobs/"), ("state=FAILED", "/api/v1/jobs/?state=FAILED"),
                               (f"page={deep}", f"/api/v1/jobs/?page={deep}")):
                _get(server.base, token, path)  # warm
                answers = [_get(server.base, token, path) for _ in range(args.read_requests)]
                latencies = [s for _, s in answers]
                entry = {"db": db, "jobs": args.read_jobs, "page": page, "requests": len(answers),
                         "p50_ms": percentile_ms(latencies, 50), "p95_ms": percentile_ms(latencies, 95),
                         "p99_ms": percentile_ms(latencies, 99),
                         "errors": sum(1 for status, _ in answers if status != 200)}
                say(f"[reads {db}] {json.dumps(entry)}")
                out.append(entry)
    return out


# ----------------------------------------------------------------------------------------- 4. agents
def service_cpu(server: Any) -> dict[int, tuple[str, float]]:
    """pid -> (role, user + system CPU seconds) of every live process the bench's server started: web
    (gunicorn), worker, beat, serve, and what they started (the `local` provider's instance agents). Found
    by parentage: where setproctitle is installed (mutmut brings it) gunicorn renames its processes, and the
    var dir in their environment can no longer be read back: the bench then missed the web server's CPU."""
    from bench.procs import cpu_seconds
    from bench.procs import process_role, process_tree

    out = {}
    for pid, argv in process_tree([p.pid for p in server.processes]).items():
        with contextlib.suppress(OSError):
            out[pid] = (process_role(argv), cpu_seconds(pid))
    return out


def cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two `service_cpu` readings (a process started between them counts whole)."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent[role] = spent.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return spent


def cpu_per_request(cpu: dict[str, float], generator_s: float, requests: int, wall_s: float) -> dict[str, Any]:
    """The service's CPU per answered request, per role and in all, with the load generator's own
    (far less sensitive to other work on the machine than requests/s), and the cores each used."""
    if not requests:
        return {}
    total = sum(cpu.values())
    return {"cpu_ms_per_request": round(1000 * total / requests, 2),
            "cpu_ms_per_request_by_process": {role: round(1000 * s / requests, 2) for role, s in sorted(cpu.items())},
            "generator_cpu_ms_per_request": round(1000 * generator_s / requests, 2),
            "service_cores": round(total / wall_s, 2) if wall_s else None,
            "web_cores": round(cpu.get("web", 0.0) / wall_s, 2) if wall_s else None,
            "load_average_1m": round(os.getloadavg()[0], 2)}


def _post(base: str, path: str, body: dict, token: str | None = None, timeout: float = 30) -> tuple[int, dict, float]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(), method="POST", headers=headers)
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    except OSError as exc:
        return -1, {"error": repr(exc)}, time.perf_counter() - started
    seconds = time.perf_counter() - started
    try:
        return status, json.loads(raw or b"{}"), seconds
    except ValueError:
        return status, {"raw": raw[:200].decode(errors="replace")}, seconds


def register_nodes(base: str, join_token: str, count: int, threads: int = 8) -> list[tuple[str, dict]]:
    """`count` fake 4xT4 nodes registered through the agent API; (node token, heartbeat body) each."""
    from agent.backends.fake import FakeBackend
    from agent.protocol import heartbeat_payload, registration_payload

    def one(i: int) -> tuple[str, dict]:
        name = f"hb-{i:04d}"
        fake = FakeBackend("4xT4", hostname=name)
        fake.start()
        body = registration_payload(inventory=fake.inventory(), join_token=join_token, name=name,
                                    agent_key=f"bench-key-{i:06d}", labels={"bench": "heartbeat"})
        status, answer, _ = _post(base, "/api/v1/agent/register", body)
        if status not in (200, 201):
            raise RuntimeError(f"registering {name}: {status} {answer}")
        beat = heartbeat_payload(readings=fake.sample(), sampled_at=time.time(), running={},
                                 max_epoch=answer.get("epoch", 0), missed_heartbeats=0, last_error=None)
        return answer["node_token"], beat

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(one, range(count)))


def heartbeat_load(base: str, nodes: list[tuple[str, dict]], *, period_s: float, seconds: float,
                   threads: int) -> dict[str, Any]:
    """Every node heartbeats every `period_s` (phases spread evenly) for `seconds`, from `threads`
    threads: latency of each heartbeat, how late the generator sent it, and how many of those due in
    the window it could not send before the window ended (the broker too slow for the rate)."""
    start = time.monotonic() + 1.0
    due = [(start + period_s * i / len(nodes), i) for i in range(len(nodes))]
    heapq.heapify(due)
    lock = threading.Lock()
    stop_at = start + seconds
    latencies: list[float] = []
    lateness: list[float] = []
    errors: dict[str, int] = {}

    def worker() -> None:
        while True:
            with lock:
                # The window is bounded: what falls due after it, or is still unsent at its end because
                # the broker answers too slowly, is not sent (counted as `not_sent`).
                if not due or due[0][0] >= stop_at or time.monotonic() >= stop_at:
                    return
                when, i = heapq.heappop(due)
                heapq.heappush(due, (when + period_s, i))
            delay = when - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            token, body = nodes[i]
            sent = time.monotonic()
            status, answer, took = _post(base, "/api/v1/agent/heartbeat", {**body, "sent_at": time.time()}, token)
            with lock:
                lateness.append(max(0.0, sent - when))
                latencies.append(took)
                if status != 200:
                    key = f"{status}: {str(answer)[:120]}"
                    errors[key] = errors.get(key, 0) + 1

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = max(seconds, time.monotonic() - start)  # the last answers may come after the window
    wanted = sum(1 + int((stop_at - 1e-9 - (start + period_s * i / len(nodes))) // period_s)
                 for i in range(len(nodes)) if start + period_s * i / len(nodes) < stop_at)
    return {"heartbeats": len(latencies), "not_sent": wanted - len(latencies), "p50_ms": percentile_ms(latencies, 50),
            "p99_ms": percentile_ms(latencies, 99), "max_ms": percentile_ms(latencies, 100),
            "send_late_p99_ms": percentile_ms(lateness, 99), "errors": sum(errors.values()),
            "error_kinds": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
            "rate_per_s": round(len(latencies) / elapsed, 1), "wanted_per_s": round(wanted / seconds, 1)}


def measure_heartbeats(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    from bench.submit_load import bench_env, seeded_server

    with tempfile.TemporaryDirectory(prefix="wz-bench-svc-hb-") as var:
        env = bench_env(Path(var), WHALEZEN_AGENT_REGISTER_RATE="1000000/min")
        with seeded_server(Path(var), worker=True, env=env) as server:
            join = subprocess.run([sys.executable, "manage.py", "issue_join_token", "--tenant", "acme", "--pool",
                                   "onprem"], cwd=ROOT, env=server.env, check=True, capture_output=True,
                                  text=True).stdout.split()[-1]
            t0 = time.perf_counter()
            nodes = register_nodes(server.base, join, args.hb_nodes)
            say(f"[agents] {len(nodes)} nodes registered in {time.perf_counter() - t0:.1f} s")
            cpu_before, wall_before, generator_before = service_cpu(server), time.monotonic(), time.process_time()
            load = heartbeat_load(server.base, nodes, period_s=args.hb_period, seconds=args.hb_seconds,
                                  threads=args.hb_threads)
            spent = cpu_spent(cpu_before, service_cpu(server))
            wall = time.monotonic() - wall_before
            generator = time.process_time() - generator_before
    load["broker_cpu_pct"] = round(100 * sum(spent.values()) / wall, 1)
    load["cpu_pct_by_process"] = {role: round(100 * s / wall, 1) for role, s in sorted(spent.items())}
    load.update(cpu_per_request(spent, generator, load["heartbeats"], wall))
    load["nodes"] = len(nodes)
    load["period_s"] = args.hb_period
    load["seconds"] = args.hb_seconds
    say(f"[agents] heartbeats: {json.dumps(load)}")
    return load


def measure_agents(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    from bench import agent_cpu

    idle = agent_cpu.main(["--seconds", str(args.idle_seconds), "--windows", str(args.idle_windows)])["agent"]
    beats = measure_heartbeats(args, say)
    return {"idle_cpu_pct": idle["idle_cpu_pct"], "heartbeat_p99_ms": beats["p99_ms"],
            "broker_cpu_pct_1000_nodes": beats["broker_cpu_pct"], "idle": idle, "heartbeats": beats}


# ------------------------------------------------------------------------------------------- output
def tables(result: dict[str, Any]) -> str:
    lines = []
    if result.get("cycle"):
        lines.append("cycle       pending  runs  median s  idle s  snapshot   solve  commit  reasons  placed  idle pending")
        for c in result["cycle"]:
            ph = c["phases"]
            lines.append(f"{c['db']:<11} {c['pending']:>7} {c['runs']:>5} {str(c['median_s']):>9} {c['idle_median_s']:>7} "
                         f"{ph['snapshot']:>9} {ph['solve']:>7} {ph['commit']:>7} {ph['reasons']:>8} "
                         f"{c['placed']:>7} {c['idle_pending']:>13}"
                         + ("" if c.get("scenario", "fresh") == "fresh" else f"  ({c['scenario']})"))
    if result.get("submissions"):
        lines.append("submissions  conc     rps   p50 ms   p95 ms   p99 ms  errors  server")
        for s in result["submissions"]:
            lines.append(f"{s['db']:<11} {s['concurrency']:>5} {s['rps']:>7} {s['p50_ms']:>8} {s['p95_ms']:>8} "
                         f"{s['p99_ms']:>8} {s['errors']:>7}  {s['server']}")
    if result.get("reads"):
        lines.append("reads          jobs  page           p50 ms   p99 ms  errors")
        for r in result["reads"]:
            lines.append(f"{r['db']:<11} {r['jobs']:>7}  {r['page']:<13} {r['p50_ms']:>8} {r['p99_ms']:>8} "
                         f"{r['errors']:>7}")
    if result.get("agent"):
        a = result["agent"]
        lines.append(f"agent: idle {a['idle_cpu_pct']}% of a core; {a['heartbeats']['nodes']} nodes every "
                     f"{a['heartbeats']['period_s']:g} s: heartbeat p50 {a['heartbeats']['p50_ms']} ms, p99 "
                     f"{a['heartbeat_p99_ms']} ms, broker {a['broker_cpu_pct_1000_nodes']}% of a core, "
                     f"{a['heartbeats']['errors']} errors")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.service", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--db", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    p.add_argument("--parts", default="cycle,submissions,reads,agents")
    p.add_argument("--quick", action="store_true", help="a tiny run of every part (shape check, not figures)")
    p.add_argument("--sizes", default="1000,5000,20000", help="pending jobs per cycle measurement")
    p.add_argument("--repeat", type=int, default=5, help="cycle repetitions per size")
    p.add_argument("--cycle-budget", type=float, default=300.0,
                   help="seconds of repetitions per size after which fewer than --repeat are kept")
    p.add_argument("--saturated", type=int, default=5000,
                   help="after the largest size, the idle cycle on the full cluster with this many pending (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=Path, default=NODES_CSV)
    p.add_argument("--pods", type=Path, default=PODS_CSV)
    p.add_argument("--node-limit", type=int, default=None, help="use only the first N nodes (tests)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests-per-thread", type=int, default=50)
    p.add_argument("--min-requests", type=int, default=300)
    p.add_argument("--no-cloud-sim", action="store_true",
                   help="submissions: without the demo's cloud-sim pools (their simulated instances' agents run here)")
    p.add_argument("--read-jobs", type=int, default=100_000)
    p.add_argument("--read-requests", type=int, default=200)
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--idle-windows", type=int, default=3)
    p.add_argument("--hb-nodes", type=int, default=1000)
    p.add_argument("--hb-period", type=float, default=5.0)
    p.add_argument("--hb-seconds", type=float, default=60.0)
    p.add_argument("--hb-threads", type=int, default=64)
    p.add_argument("--redis-db", type=int, default=7)
    p.add_argument("--cycle-worker", help=argparse.SUPPRESS)
    p.add_argument("--bulk-jobs", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeat, args.node_limit, args.saturated = "20,40", 2, args.node_limit or 30, 10
        args.concurrency, args.requests_per_thread, args.min_requests = "1,4", 5, 10
        args.read_jobs, args.read_requests = 500, 10
        args.idle_seconds, args.idle_windows = 2.0, 1
        args.hb_nodes, args.hb_period, args.hb_seconds, args.hb_threads = 10, 1.0, 3.0, 4
    args.sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    args.dbs = [d.strip() for d in args.db.split(",") if d.strip()]
    args.part_list = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(args.part_list) - {"cycle", "submissions", "reads", "agents"}
    if unknown:
        p.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.cycle_worker:
        print(json.dumps(cycle_worker(json.loads(args.cycle_worker))))
        return {}
    if args.bulk_jobs is not None:
        bulk_jobs(args.bulk_jobs)
        return {}
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    say("(a shared 2-core machine: every figure is a median on a noisy machine)")
    result: dict[str, Any] = {"cycle": [], "submissions": [], "reads": [], "agent": {}}
    for db in args.dbs:
        if "cycle" in args.part_list:
            result["cycle"] += measure_cycle(db, args, say)
        if "submissions" in args.part_list:
            result["submissions"] += measure_submissions(db, args, say)
        if "reads" in args.part_list:
            result["reads"] += measure_reads(db, args, say)
    if "agents" in args.part_list:
        result["agent"] = measure_agents(args, say)
    print(tables(result))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
