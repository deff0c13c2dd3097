"""Job submissions per second through the real web server on the embedded default (SQLite).

Starts what `make run` starts, minus the demo agents (`manage.py serve --no-agents`: the web server plus
the Celery worker and beat, whose scheduling cycles write to the same database), on a fresh SQLite
database with the demo data in a temporary folder, then fires `--requests` job submissions from
`--concurrency` threads (loopback only) with the demo tokens and counts the answers.

    .venv/bin/python -m bench.submit_load [--requests 1700] [--concurrency 32] [--no-worker] [--json]

The last line with --json is one JSON object: {"requests", "concurrency", "seconds", "requests_per_s",
"p50_ms", "p95_ms", "p99_ms", "statuses" (answer status -> count), "errors" (answers that are not 201),
"html_errors" (answers with an HTML body), "jobs_created" (201 answers), "error_kinds" (the commonest error excerpts -> count)}.

The submission throttle (`WHALEZEN_SUBMIT_RATE`) is lifted for the run: this measures the database, not
the rate limit. `production_server` starts docker-compose.yml's service instead (gunicorn with three
workers, Celery worker and beat, production settings) on a PostgreSQL/Redis environment; bench/service.py
measures both.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.hostile_input import _wait_up
from bench.procs import free_port
from bench.procs import live_processes
from broker.ops.web import web_command

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"name": "load", "command": ["python", "-c", "pass"], "resources": {"gpus": 1},
        "expected_duration_hours": 1}


@dataclass
class Server:
    base: str
    tokens: list[str]
    var_dir: Path
    env: dict[str, str]
    process: subprocess.Popen = field(repr=False)
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)  # all it started


def _seed(env: dict[str, str]) -> list[str]:
    """Migrate and seed the demo data; the demo tokens (acme's first)."""
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    seeded = subprocess.run([sys.executable, "manage.py", "seed_demo"], cwd=ROOT, env=env, check=True,
                            capture_output=True, text=True).stdout
    return [line.split()[2] for line in seeded.splitlines() if line.startswith("TOKEN ")]


def bench_env(var_dir: Path, db_env: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a bench server: a var dir of its own, the submission throttle lifted, the
    given database (none: the embedded SQLite under `var_dir`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_DEBUG")}
    env.update({"WHALEZEN_VAR_DIR": str(var_dir), "DJANGO_SETTINGS_MODULE": "broker.settings",
                "WHALEZEN_SUBMIT_RATE": "1000000/min", "WHALEZEN_TASKS_EAGER": "0",
                **(db_env or {}), **extra})
    return env


@contextlib.contextmanager
def seeded_server(var_dir: Path, *, worker: bool = True, env: dict[str, str] | None = None,
                  prepare: Callable[[dict[str, str]], None] | None = None) -> Iterator[Server]:
    """A migrated, seeded SQLite broker under `var_dir`, served on a free loopback port: what `make run`
    starts less the demo agents (`serve --no-agents`), or the web server alone (`worker=False`).
    `prepare(env)` runs after seeding, before the server starts (e.g. bulk data)."""
    env = env or bench_env(var_dir)
    tokens = _seed(env)
    if prepare is not None:
        prepare(env)
    port = free_port()
    if worker:
        command = ["manage.py", "serve", "--no-agents", "--host", "127.0.0.1", "--port", str(port)]
    else:
        command = web_command(host="127.0.0.1", port=port)[1:]
    with _served([([sys.executable, *command], {})], var_dir, env, f"http://127.0.0.1:{port}", tokens) as server:
        yield server


# What docker-compose.yml runs (web, worker, beat), on loopback: the production settings, gunicorn with
# three sync workers, Celery with four. The worker runs at nice 5: a process's CPU weight is then 335
# against the web's 1024, as compose's `cpu_shares: 341` gives the worker's container.
PRODUCTION_WORKER_NICENESS = 5
PRODUCTION_ENV = {"DJANGO_ENV": "production", "DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": "bench-" + "x" * 60,
                  "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost", "DJANGO_SECURE_SSL_REDIRECT": "0",
                  "DJANGO_CSRF_TRUSTED_ORIGINS": "http://127.0.0.1"}


def production_commands(port: int, *, worker: bool = True, var_dir: Path) -> list[tuple[list[str], dict[str, str]]]:
    """docker-compose.yml's web (and worker and beat) commands, bound to loopback, each with the
    environment it adds (the web's three workers share an empty PROMETHEUS_MULTIPROC_DIR)."""
    bin_dir = Path(sys.executable).parent
    metrics = var_dir / "whalezen-metrics"
    metrics.mkdir(parents=True, exist_ok=True)
    commands = [([str(bin_dir / "gunicorn"), "broker.wsgi", "--bind", f"127.0.0.1:{port}", "--workers", "3",
                  "--timeout", "60"], {"PROMETHEUS_MULTIPROC_DIR": str(metrics)})]
    if worker:
        commands += [(["nice", "-n", str(PRODUCTION_WORKER_NICENESS), str(bin_dir / "celery"), "-A", "broker",
                       "worker", "--loglevel", "WARNING", "--concurrency", "4"], {}),
                     ([str(bin_dir / "celery"), "-A", "broker", "beat", "--loglevel", "WARNING", "--schedule",
                       str(var_dir / "celerybeat-schedule")], {})]
    return commands


@contextlib.contextmanager
def production_server(var_dir: Path, db_env: dict[str, str], *, worker: bool = True,
                      prepare: Callable[[dict[str, str]], None] | None = None) -> Iterator[Server]:
    """The docker-compose.yml service without docker: migrate, seed_demo, then gunicorn (3 workers)
    plus, with `worker`, the Celery worker and beat, on the given PostgreSQL/Redis environment."""
    env = bench_env(var_dir, db_env, **PRODUCTION_ENV)
    tokens = _seed(env)
    if prepare is not None:
        prepare(env)
    port = free_port()
    with _served(production_commands(port, worker=worker, var_dir=var_dir), var_dir, env,
                 f"http://127.0.0.1:{port}", tokens) as server:
        yield server


@contextlib.contextmanager
def _served(commands: list[tuple[list[str], dict[str, str]]], var_dir: Path, env: dict[str, str], base: str,
            tokens: list[str]) -> Iterator[Server]:
    log = open(var_dir / "server.log", "ab")
    # Each in its own process group: a command's children (web, worker) stop with it even if it is killed.
    processes = [subprocess.Popen(command, cwd=ROOT, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True) for command, extra in commands]
    try:
        _wait_up(base)
        yield Server(base=base, tokens=tokens, var_dir=var_dir, env=env, process=processes[0],
                     processes=processes)
    finally:
        for process in processes:
            _stop(process)
        _reap(var_dir)
        log.close()


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # whatever is left of the group
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def _reap(var_dir: Path) -> None:
    """Stop what the run left behind under `var_dir`: the `local` provider's instance agents run in
    their own sessions and may outlive `serve` (issue 8, item 9)."""
    marker = str(var_dir)
    for pid, argv, _ in live_processes():
        if any(marker in arg for arg in argv):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@dataclass(frozen=True)
class Answer:
    status: int | str  # an HTTP status, or "timeout" / "connection"
    seconds: float
    body: bytes
    content_type: str


def submit(base: str, token: str, timeout_s: float) -> Answer:
    request = urllib.request.Request(f"{base}/api/v1/jobs/", data=json.dumps(SPEC).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {token}"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, body, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, body, ctype = err.code, err.read(), err.headers.get("Content-Type", "")
    except TimeoutError:
        status, body, ctype = "timeout", b"", ""
    except OSError as exc:  # refused or reset: say which
        status, body, ctype = "connection", repr(exc).encode(), ""
    return Answer(status=status, seconds=time.perf_counter() - start, body=body, content_type=ctype)


def fire(server: Server, *, requests: int, concurrency: int, timeout_s: float = 60.0) -> tuple[list[Answer], float]:
    """`requests` submissions from `concurrency` threads, alternating between the demo tokens."""
    tokens = server.tokens
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(pool.map(lambda i: submit(server.base, tokens[i % len(tokens)], timeout_s), range(requests)))
    return answers, time.perf_counter() - start


def summarize(answers: list[Answer], seconds: float, concurrency: int) -> dict:
    latencies = sorted(a.seconds for a in answers)
    errors = [a for a in answers if a.status != 201]
    p99_index = min(len(latencies) - 1, max(0, round(0.99 * len(latencies)) - 1))
    return {
        "requests": len(answers), "concurrency": concurrency, "seconds": round(seconds, 2),
        "requests_per_s": round(len(answers) / seconds, 1) if seconds else None,
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p95_ms": round(percentile(latencies, 95) * 1000, 1), "p99_ms": round(latencies[p99_index] * 1000, 1),
        "statuses": {str(k): v for k, v in sorted(Counter(a.status for a in answers).items(), key=str)},
        "errors": len(errors),
        "html_errors": sum(1 for a in errors if "html" in a.content_type),
        "jobs_created": sum(1 for a in answers if a.status == 201),
        "error_kinds": dict(Counter(_excerpt(a) for a in errors).most_common(5)),
    }


def percentile(sorted_values: list[float], pct: float) -> float:
    """The nearest-rank percentile of an ascending list (p99 of 200 values: the 198th)."""
    index = min(len(sorted_values) - 1, max(0, round(pct / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


def _excerpt(answer: Answer) -> str:
    text = answer.body.decode("utf-8", "replace")
    if "html" in answer.content_type:  # Django's debug page: its title and exception value say what went wrong
        text = " ".join(_between(text, tag, "</") for tag in ("<title>", '<pre class="exception_value">')) or text
    return f"{answer.status}: {' '.join(text.split())[:160]}"


def _between(text: str, start: str, end: str) -> str:
    i = text.find(start)
    return text[i + len(start):text.find(end, i + len(start))].strip() if i >= 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1700)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--no-worker", action="store_true", help="web server only (no Celery worker)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for one answer")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="wz-load-") as var:
        with seeded_server(Path(var), worker=not args.no_worker) as server:
            answers, seconds = fire(server, requests=args.requests, concurrency=args.concurrency,
                                    timeout_s=args.timeout)
    result = summarize(answers, seconds, args.concurrency)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
