"""How long a running job is down when WhaleZen moves it, and how much work a lost node costs it.

Starts the whole service as `make run` does (`manage.py serve` with the demo agents: real agent
processes running real job processes) in a temporary var dir with a checkpoint root of its own, on a
free loopback port, once per database kind (`sqlite`: the embedded defaults; `postgresql`: a fresh
PostgreSQL database and a Redis db of its own, dropped and flushed afterwards), then per run, through
the HTTP API with the demo token of `acme`:

1. submits the toy training job (examples/train_toy.yaml, a fresh checkpoint folder per run) and
   times submit -> RUNNING (`submit_to_running_s`, polled every 0.1 s);
2. waits for its first committed checkpoint, asks for a move anywhere (`POST .../migrate/ {}`) and
   reads the finished move's `downtime_s` and phases (`checkpoint`, `fence`, `start`), plus `restore`:
   what the toy says its restore took in its log on the target (`restored from step N in X.XXX s`);
3. once it runs again and has committed a checkpoint there, waits a random part of the checkpoint
   interval (seeded: a node fails at any moment) and SIGKILLs the agent of its node (the job dies with it), reads the last `step N` of the old log and the `restored from step M` of the job's
   log where it runs again, and reports `lost_work_s_after_agent_kill` = (N - M) * step seconds.

    .venv/bin/python -m bench.migration [--runs 5] [--db sqlite,postgresql] [--json]

The last line with --json is one JSON object: {"runs": [{"db", "submit_to_running_s",
"migration_downtime_s", "phases": {"checkpoint", "fence", "start", "restore"},
"lost_work_s_after_agent_kill", "lost_work_steps", "runs_measured", "checkpoint_interval_s",
"step_seconds", "settings"}]}, one entry per database kind, each figure the median of the runs.

Settings changed for the run (they bound how soon a lost node's job starts again, not the work it
loses): WHALEZEN_NODE_LOST_AFTER_SECONDS=12, WHALEZEN_FENCE_WAIT_SECONDS=15 and a lost-node sweep every
3 s (WHALEZEN_LOST_SWEEP_SECONDS) instead of 30 s, 940 s and 10 s.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from bench.backends import POSTGRES_SERVER, REDIS_SERVER, backend  # noqa: F401 (re-exported)
from bench.procs import free_port, live_processes

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.1  # the brief's polling interval for state changes

# The toy's timings for the bench: short steps so a lost step is a small, well-resolved amount of
# time, and a checkpoint every 5 s (the demo uses 10 s) so each run waits less for one.
STEP_SECONDS = 0.1
CHECKPOINT_EVERY_SECONDS = 5.0
TOY_STEPS = 20000  # far more than a run needs: the bench cancels the job at the end of each run

# Shorter failure detection than the defaults, so a killed agent's job restarts within a minute.
SERVICE_SETTINGS = {"WHALEZEN_NODE_LOST_AFTER_SECONDS": "12", "WHALEZEN_FENCE_WAIT_SECONDS": "15",
                    "WHALEZEN_LOST_SWEEP_SECONDS": "3"}

STEP_RE = re.compile(r"^step (\d+) loss ", re.M)
RESTORED_RE = re.compile(r"^restored from step (\d+)(?: in ([0-9.]+) s)?", re.M)

T = TypeVar("T")


class BenchError(RuntimeError):
    """A run could not be measured (the service did not do what the step waits for in time)."""


# -- pure parts (tested in tests/bench/test_bench_migration.py) -------------------------------------
def last_step(log_text: str) -> int | None:
    """The last `step N loss X` the toy printed, or None before its first step."""
    steps = STEP_RE.findall(log_text)
    return int(steps[-1]) if steps else None


def restored(log_text: str) -> tuple[int, float | None] | None:
    """(step, seconds) of the toy's `restored from step N[ in X.XXX s]` line; None if it did not restore."""
    match = RESTORED_RE.search(log_text)
    if match is None:
        return None
    return int(match.group(1)), float(match.group(2)) if match.group(2) else None


def lost_work(last_step_before: int, restored_step: int, step_seconds: float) -> tuple[int, float]:
    """Steps (and their seconds) done after the checkpoint the job restarted from: they are done twice."""
    steps = max(0, last_step_before - restored_step)
    return steps, round(steps * step_seconds, 3)


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


PHASES = ("checkpoint", "fence", "start", "restore")
OPEN_MOVE_STATES = ("CHECKPOINTING", "STOPPING", "PLACING")  # broker.jobs.models.Migration.OPEN_STATES


def summarize(db: str, runs: list[dict[str, Any]], *, step_seconds: float = STEP_SECONDS,
              checkpoint_interval_s: float = CHECKPOINT_EVERY_SECONDS) -> dict[str, Any]:
    """One database kind's entry: the median of each figure over its runs."""
    return {
        "db": db,
        "submit_to_running_s": median([r["submit_to_running_s"] for r in runs]),
        "migration_downtime_s": median([r["migration_downtime_s"] for r in runs]),
        "phases": {p: median([r["phases"].get(p) for r in runs]) for p in PHASES},
        "lost_work_s_after_agent_kill": median([r["lost_work_s_after_agent_kill"] for r in runs]),
        "lost_work_steps": median([r["lost_work_steps"] for r in runs]),
        "runs_measured": len(runs),
        "checkpoint_interval_s": checkpoint_interval_s,
        "step_seconds": step_seconds,
        "settings": dict(SERVICE_SETTINGS),
    }


def table(entries: list[dict[str, Any]]) -> str:
    """The medians as a readable table, one row per database kind."""
    head = ("db", "runs", "submit->RUNNING s", "downtime s", "checkpoint", "fence", "start", "restore",
            "lost s (steps)")
    rows = [head]
    for e in entries:
        ph = e["phases"]
        rows.append((e["db"], str(e["runs_measured"]), _fmt(e["submit_to_running_s"]),
                     _fmt(e["migration_downtime_s"]), *(_fmt(ph[p]) for p in PHASES),
                     f"{_fmt(e['lost_work_s_after_agent_kill'])} ({_fmt(e['lost_work_steps'])})"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def toy_spec(template: str, *, checkpoint_uri: str, run: str) -> dict[str, Any]:
    """examples/train_toy.yaml with its placeholders filled and the bench's timings on its command line."""
    spec = yaml.safe_load(template.replace("@WHALEZEN@", str(ROOT)).replace("@RUN@", run))
    spec["name"] = f"bench-migration-{run}"
    spec["checkpoint"]["uri"] = checkpoint_uri  # under this bench's own WHALEZEN_CHECKPOINT_ROOTS
    command = [str(a) for a in spec["command"]]
    for flag, value in (("--steps", TOY_STEPS), ("--step-seconds", STEP_SECONDS),
                        ("--checkpoint-every-seconds", CHECKPOINT_EVERY_SECONDS)):
        if flag in command:
            command[command.index(flag) + 1] = str(value)
        else:
            command += [flag, str(value)]
    spec["command"] = command + ["--print-restore-seconds"]
    return spec


# -- waiting and HTTP -------------------------------------------------------------------------------
def wait_for(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = POLL_S) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (urllib.error.URLError, OSError) as exc:  # a restarting part of the service: ask again
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise BenchError(f"timed out after {timeout:g} s waiting for {what}; last: {last!r}"[:600])


@dataclass
class Api:
    base: str
    token: str

    def call(self, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.base}/api/v1/{path}", data=data, method="POST" if data else "GET",
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=15) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            raise BenchError(f"{request.method} {path}: {err.code} {err.read()[:300]!r}") from None

    def job(self, job_id: int) -> dict:
        return self.call(f"jobs/{job_id}/")

    def results(self, path: str) -> list[dict]:
        body = self.call(path)
        return body["results"] if isinstance(body, dict) else body


# -- the service ------------------------------------------------------------------------------------
@dataclass
class Service:
    base: str
    token: str
    var_dir: Path
    checkpoint_root: Path
    env: dict[str, str]
    process: subprocess.Popen = field(repr=False)
    restarted_agents: list[subprocess.Popen] = field(default_factory=list, repr=False)


@contextlib.contextmanager
def service(extra_env: dict[str, str]) -> Iterator[Service]:
    """`make run` in a temp var dir: migrate, seed_demo, `manage.py serve` with its demo agents."""
    var_dir = Path(tempfile.mkdtemp(prefix="wz-bench-mig-"))
    # Jobs run as an unprivileged user: their checkpoint root must be theirs to write (sticky, as the demo's).
    checkpoint_root = Path(tempfile.mkdtemp(prefix="wz-bench-mig-ckpt-"))
    checkpoint_root.chmod(0o1777)
    var_dir.chmod(0o711)  # jobs' work dirs lie under it; serve keeps it 0711 too
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(WHALEZEN_VAR_DIR=str(var_dir), WHALEZEN_CHECKPOINT_ROOTS=str(checkpoint_root),
               DJANGO_SETTINGS_MODULE="broker.settings", PYTHONUNBUFFERED="1", **SERVICE_SETTINGS, **extra_env)
    process = None
    restarted: list[subprocess.Popen] = []  # agents the bench itself started again after killing them
    log = open(var_dir / "bench-serve.out", "ab")
    try:
        manage = [sys.executable, "manage.py"]
        subprocess.run([*manage, "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
        seeded = subprocess.run([*manage, "seed_demo"], cwd=ROOT, env=env, check=True, capture_output=True,
                                text=True).stdout
        token = next(line.split()[2] for line in seeded.splitlines() if line.startswith("TOKEN acme "))
        port = free_port()
        # Its own session, as a terminal gives `make run`: the group is what the stop signals.
        process = subprocess.Popen([*manage, "serve", "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                                   env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        out = var_dir / "bench-serve.out"
        wait_for(lambda: "WhaleZen is up" in out.read_text(errors="replace") or process.poll() is not None,
                 300, "the service to start", interval=0.5)
        if process.poll() is not None:
            raise BenchError(f"serve exited {process.returncode}: {out.read_text(errors='replace')[-2000:]}")
        svc = Service(base=f"http://127.0.0.1:{port}", token=token, var_dir=var_dir,
                      checkpoint_root=checkpoint_root, env=env, process=process, restarted_agents=restarted)
        yield svc
    finally:
        if process is not None:
            _stop_group(process)
        for agent in restarted:
            _stop_group(agent)
        _kill_leftovers(var_dir, checkpoint_root)
        log.close()
        shutil.rmtree(var_dir, ignore_errors=True)
        shutil.rmtree(checkpoint_root, ignore_errors=True)


def _stop_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def _kill_leftovers(*dirs: Path) -> None:
    """SIGKILL whatever still belongs to this bench: its var dir in a process's command line or
    environment (agents, web, worker), or its checkpoint root (jobs run with a clean environment but
    get WHALEZEN_CHECKPOINT_URI under it)."""
    needles = [str(d).encode() for d in dirs]
    for pid, argv, environ in live_processes():
        joined = " ".join(argv).encode()
        if any(n in joined or n in environ for n in needles):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def job_logs(var_dir: Path) -> set[Path]:
    """Every job log the demo agents keep (`<agent state dir>-jobs/<allocation id>/job.log`)."""
    return set((var_dir / "demo-agents").glob("**/job.log"))


def new_log_on(var_dir: Path, node: str, known: set[Path]) -> Path | None:
    """The one job log on `node` that was not there before (the job's new allocation)."""
    fresh = [p for p in job_logs(var_dir) - known if f"/{node}-jobs/" in str(p) or f"/{node}/" in str(p)]
    return fresh[0] if len(fresh) == 1 else None


def agent_of(node: str, var_dir: Path) -> tuple[int, list[str], bytes]:
    """pid, argv and environment of the live agent process of `node` started for this var dir. The
    demo runs each agent under a simulated instance (providers/local/instance.py) whose command line
    holds the agent's: only the `python -m agent` process itself is the agent."""
    for pid, argv, environ in live_processes():
        if argv[1:3] == ["-m", "agent"] and "--name" in argv and argv[argv.index("--name") + 1] == node \
                and str(var_dir) in " ".join(argv):
            return pid, argv, environ
    raise BenchError(f"no agent process found for node {node}")


def restart_agent(svc: Service, argv: list[str], environ: bytes) -> None:
    """Start the killed node's agent again, as a restarted machine would: it keeps its node token in
    its state dir, so it needs no join token (`serve` only passes one on stdin at first start)."""
    # Without its simulated instance there is no metadata endpoint to poll for spot notices either.
    for flag in ("--join-token", "--spot-notice", "--metadata-url"):
        if flag in argv:
            i = argv.index(flag)
            argv = argv[:i] + argv[i + 2:]
    env = dict(item.split(b"=", 1) for item in environ.split(b"\0") if b"=" in item)
    out = open(svc.var_dir / f"bench-agent-{len(svc.restarted_agents)}.out", "ab")
    svc.restarted_agents.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True))
    out.close()


# -- one run ----------------------------------------------------------------------------------------
def running_on(api: Api, job_id: int, not_on: str | None = None) -> str | None:
    """The node the job runs on once it is RUNNING (on another node than `not_on`), else None."""
    job = api.job(job_id)
    if job["state"] in ("FAILED", "CANCELLED", "SUCCEEDED"):
        raise BenchError(f"job {job_id} ended: {job['state']}")
    nodes = [a["node"] for a in job["allocations"]]
    if job["state"] == "RUNNING" and nodes and nodes[0] != not_on:
        return nodes[0]
    return None


def committed_after(api: Api, job_id: int, step: int) -> dict | None:
    """A committed checkpoint of the job past `step`."""
    done = [c for c in api.results(f"jobs/{job_id}/checkpoints/") if c["state"] == "COMMITTED" and c["step"] > step]
    return max(done, key=lambda c: c["step"]) if done else None


def wait_restored(log: Path, timeout: float = 120) -> tuple[int, float | None]:
    return wait_for(lambda: restored(log.read_text(errors="replace")), timeout, f"'restored from step' in {log}")


def measure_run(svc: Service, api: Api, template: str, index: int, rng: random.Random) -> dict[str, Any]:
    run = f"run{index}-{uuid.uuid4().hex[:6]}"
    spec = toy_spec(template, checkpoint_uri=str(svc.checkpoint_root / run), run=run)
    known = job_logs(svc.var_dir)

    # 1. submit -> RUNNING
    started = time.monotonic()
    job_id = api.call("jobs/", spec)["id"]
    source = wait_for(lambda: running_on(api, job_id), 180, f"job {job_id} to run")
    submit_to_running = time.monotonic() - started
    first_log = wait_for(lambda: new_log_on(svc.var_dir, source, known), 30, f"job {job_id}'s log on {source}")
    known |= {first_log}
    try:
        # 2. a move anywhere once a checkpoint is committed
        wait_for(lambda: committed_after(api, job_id, -1), 120, "the first committed checkpoint")
        api.call(f"jobs/{job_id}/migrate/", {})
        move = wait_for(lambda: _finished_move(api, job_id), 300, "the move to complete", interval=0.5)
        target = move["to"]
        target_log = wait_for(lambda: new_log_on(svc.var_dir, target, known), 60, f"job {job_id}'s log on {target}")
        known |= {target_log}
        target_step, restore_s = wait_restored(target_log)

        # 3. SIGKILL the agent of the node it runs on, once it has committed a checkpoint there
        wait_for(lambda: running_on(api, job_id), 60, "the job to run on the target")
        wait_for(lambda: committed_after(api, job_id, move["restored_step"] or -1), 120,
                 "a committed checkpoint on the target")
        # A node dies at any moment, not just after a commit: kill it at a random point of the
        # checkpoint interval (seeded), or every run would measure the least possible loss.
        kill_delay = round(rng.uniform(0.0, CHECKPOINT_EVERY_SECONDS), 3)
        time.sleep(kill_delay)
        pid, argv, environ = agent_of(target, svc.var_dir)
        os.kill(pid, signal.SIGKILL)
        before = _settled_last_step(target_log)
        after_node = wait_for(lambda: running_on(api, job_id, not_on=target), 300,
                              "the job to run again after the agent kill", interval=0.5)
        after_log = wait_for(lambda: new_log_on(svc.var_dir, after_node, known), 60,
                             f"job {job_id}'s log on {after_node}")
        restored_step, _ = wait_restored(after_log)
        steps, seconds = lost_work(before, restored_step, STEP_SECONDS)
        restart_agent(svc, argv, environ)  # the next run needs two A100 nodes again
        return {"submit_to_running_s": round(submit_to_running, 3), "migration_downtime_s": move["downtime_s"],
                "phases": {**move["phases"], "restore": restore_s}, "lost_work_s_after_agent_kill": seconds,
                "lost_work_steps": steps, "kill_after_commit_s": kill_delay,
                "restored_step_in_log": target_step, "migration_restored_step": move["restored_step"],
                "nodes": [source, target, after_node]}
    finally:
        with contextlib.suppress(BenchError, OSError):
            api.call(f"jobs/{job_id}/cancel/", {})
        # Wait for the demo nodes to be ONLINE and free before the next run asks for A100s again.
        with contextlib.suppress(BenchError):
            wait_for(lambda: _all_online(api) and _ended(api, job_id), 120, "the nodes to be ONLINE again",
                     interval=0.5)


def _finished_move(api: Api, job_id: int) -> dict | None:
    moves = api.results(f"jobs/{job_id}/migrations/")
    if not moves:
        return None
    latest = max(moves, key=lambda m: m["id"])
    if latest["state"] == "COMPLETED":
        return latest
    if latest["state"] not in OPEN_MOVE_STATES:
        raise BenchError(f"move ended {latest['state']}: {latest.get('outcome')}")
    return None


def _settled_last_step(log: Path) -> int:
    """The job's last step once its log has stopped growing (it dies with its agent)."""
    previous, quiet_since = -1, time.monotonic()
    deadline = quiet_since + 60
    while time.monotonic() - quiet_since < 2.0:
        if time.monotonic() > deadline:
            raise BenchError(f"{log} still grows a minute after its agent was killed")
        size = log.stat().st_size
        if size != previous:
            previous, quiet_since = size, time.monotonic()
        time.sleep(POLL_S)
    step = last_step(log.read_text(errors="replace"))
    if step is None:
        raise BenchError(f"no step in {log}")
    return step


def _all_online(api: Api) -> bool:
    return all(n["state"] == "ONLINE" for n in api.results("nodes/") if n["name"].startswith("acme-a100"))


def _ended(api: Api, job_id: int) -> bool:
    return api.job(job_id)["state"] in ("CANCELLED", "FAILED", "SUCCEEDED")


def measure_db(kind: str, runs: int, redis_db: int, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    template = (ROOT / "examples" / "train_toy.yaml").read_text()
    rng = random.Random(seed)
    measured = []
    with backend(kind, redis_db) as extra, service(extra) as svc:
        api = Api(svc.base, svc.token)
        wait_for(lambda: _all_online(api), 180, "the demo A100 nodes to be ONLINE", interval=0.5)
        for index in range(runs):
            result = measure_run(svc, api, template, index, rng)
            log(f"{kind} run {index + 1}/{runs}: {json.dumps(result)}")
            measured.append(result)
    return summarize(kind, measured)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--db", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    parser.add_argument("--redis-db", type=int, default=7, help="the Redis db number to use (flushed at the end)")
    parser.add_argument("--seed", type=int, default=0, help="seeds when in its checkpoint interval a node is killed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # SIGTERM cleans up like Ctrl-C: the context managers stop the service and drop the database.
    signal.signal(signal.SIGTERM, _interrupt)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    say(f"settings for the run: {SERVICE_SETTINGS}; toy: {STEP_SECONDS} s per step, "
        f"checkpoint every {CHECKPOINT_EVERY_SECONDS} s")
    entries = [measure_db(kind.strip(), args.runs, args.redis_db, args.seed, say) for kind in args.db.split(",") if kind.strip()]
    print(table(entries))
    print(f"(medians; node lost after {SERVICE_SETTINGS['WHALEZEN_NODE_LOST_AFTER_SECONDS']} s, fence wait "
          f"{SERVICE_SETTINGS['WHALEZEN_FENCE_WAIT_SECONDS']} s, lost-node sweep every "
          f"{SERVICE_SETTINGS['WHALEZEN_LOST_SWEEP_SECONDS']} s: they bound how fast a lost node's job restarts, "
          "not the lost work)")
    if args.json:
        print(json.dumps({"runs": entries}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
