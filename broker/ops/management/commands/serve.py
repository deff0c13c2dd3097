"""`manage.py serve`: the whole service on one machine (what `make run` starts).

Three supervised processes, each in its own process group: the web server, a Celery worker and
Celery beat (file-system queue by default, Redis with REDIS_URL). A child that dies is restarted
with backoff and the log says so (serve's stdout and var/logs/serve.log; each child logs to
var/logs/<name>.log). Unless --no-agents, a node agent with fake GPUs runs for every demo node.

At start it first cleans up after a previous run that could not (SIGKILL, a crash): the service
processes it recorded, its demo agents, and the `local` provider's instances (adopted when a live
record knows them, terminated otherwise). SIGTERM or Ctrl-C stops everything it started: beat and
worker (SIGTERM to their groups, SIGKILL after --stop-grace), the simulated instances and demo
agents, then the web server.
"""
from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from broker.ops.demo_agents import start_demo_agents, stop_demo_agents, stop_simulated_cloud
from broker.ops.demo_kube import demo_kube_children
from broker.ops.services import local_instances_recover
from broker.ops.web import web_command
from broker.ops.supervisor import Backoff, ChildSpec, Supervisor, signal_on_parent_death, stop_leftovers

# The worker (scheduling cycles, launches) runs below the web server and above the demo nodes' agents and
# jobs (nice 10, providers/local): on a loaded machine requests are answered first, and a cycle waits a
# little rather than a user.
WORKER_NICENESS = int(os.environ.get("WHALEZEN_WORKER_NICE", 5))


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


class Command(BaseCommand):
    help = "Run web, worker, beat and the demo node agents, supervised, until SIGTERM or Ctrl-C."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--no-agents", action="store_true", help="do not start the demo node agents")
        parser.add_argument("--no-worker", action="store_true", help="do not start the Celery worker and beat")
        parser.add_argument("--stop-grace", type=float, default=_env_float("WHALEZEN_SERVE_STOP_GRACE_SECONDS", 10),
                            help="seconds a child gets to exit after SIGTERM before SIGKILL (default 10)")
        parser.add_argument("--restart-delay", type=float,
                            default=_env_float("WHALEZEN_SERVE_RESTART_DELAY_SECONDS", 1),
                            help="first delay before restarting a child that died; doubles up to --restart-max")
        parser.add_argument("--restart-max", type=float, default=_env_float("WHALEZEN_SERVE_RESTART_MAX_SECONDS", 30))

    def handle(self, *args, **options):
        host, port = options["host"], options["port"]
        url = f"http://{host}:{port}"
        var_dir = Path(settings.VAR_DIR)
        log_dir = var_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_dir.chmod(0o700)  # logs name jobs and nodes of every tenant; jobs on demo nodes run on this machine
        self._log_file: IO[str] = (log_dir / "serve.log").open("a")
        lock = self._lock(var_dir / "serve.lock")
        self._stop_signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._stop_with_make()

        # What a previous run left behind, before anything new starts.
        state_file = var_dir / "serve-children.json"
        stop_leftovers(state_file, log=self.say)
        stop_demo_agents(log=self.say)
        local_instances_recover(say=self.say)

        supervisor = Supervisor(self._specs(options, url, log_dir), log=self.say, state_file=state_file,
                                backoff=Backoff(initial_s=options["restart_delay"], max_s=options["restart_max"]))
        try:
            supervisor.start()
            if not options["no_agents"] and self._wait_for(url, supervisor):
                agents = start_demo_agents(server_url=url, log=self.say)
                self.say(f"{len(agents)} demo node agents started (logs under {var_dir}/demo-agents)")
            if self._stop_signal is None:
                self.say(f"WhaleZen is up at {url} (API docs: {url}/api/docs/). Ctrl-C stops.")
            while self._stop_signal is None:
                supervisor.poll()
                time.sleep(0.2)
            self.say(f"{signal.Signals(self._stop_signal).name} received: stopping")
        finally:
            grace = options["stop_grace"]
            # Beat and worker first, so nothing launches a new instance while the instances stop.
            supervisor.stop(["beat", "worker"], grace_s=grace)
            stopped = stop_simulated_cloud(log=self.say)
            # Every demo agent its state files know, not only `agents`: a start cut short may have
            # launched some before failing.
            demo = stop_demo_agents(log=lambda message: None, reason="service stopped")
            self.say(f"{stopped} simulated instance(s) and {demo} demo agent(s) stopped")
            # The demo Kubernetes bridge before its cluster, so its Pods' processes stop with the cluster.
            supervisor.stop([n for n in supervisor.children if n.startswith("kube-bridge")], grace_s=grace)
            supervisor.stop([n for n in supervisor.children if n.startswith("kube-cluster")], grace_s=grace)
            supervisor.stop(["web"], grace_s=grace)
            self.say("stopped")
            lock.close()
            self._log_file.close()

    def _specs(self, options, url: str, log_dir: Path) -> list[ChildSpec]:
        env = {**os.environ, "WHALEZEN_PUBLIC_URL": os.environ.get("WHALEZEN_PUBLIC_URL", url),
               "PORT": str(options["port"])}
        python, root = sys.executable, Path(settings.BASE_DIR)
        specs = [ChildSpec("web", web_command(host=options["host"], port=options["port"], python=python), env,
                           log_dir / "web.log", cwd=root)]
        if not options["no_worker"]:
            celery = [python, "-m", "celery", "-A", "broker"]
            specs.append(ChildSpec("worker", celery + ["worker", "--pool", "solo", "--loglevel", "INFO"], env,
                                   log_dir / "worker.log", cwd=root, niceness=WORKER_NICENESS))
            # A process of its own (not `worker -B`): a dead beat is noticed and restarted on its own.
            # No pidfile: the supervisor is what keeps a second beat from starting.
            specs.append(ChildSpec("beat", celery + ["beat", "--loglevel", "INFO", "--pidfile=",
                                                     "-s", str(Path(settings.VAR_DIR) / "celerybeat-schedule")],
                                   env, log_dir / "beat.log", cwd=root))
        if not options["no_agents"]:  # the opt-in demo Kubernetes cluster and its bridge (broker/ops/demo_kube.py)
            specs += [ChildSpec(child.name, child.argv, env, log_dir / f"{child.name}.log", cwd=root,
                                after_file=child.after_file)
                      for child in demo_kube_children(server_url=url, python=python)]
        return specs

    def _stop_with_make(self) -> None:
        """Under `make run`, a SIGTERM sent to make alone (`kill <pid of make>`, not its process group)
        never reaches serve: make does not forward it, and serve would run on. So serve asks for a
        SIGTERM when make dies. Only for make: a shell or wrapper that exits may mean to leave it running."""
        parent = os.getppid()
        try:
            name = Path(f"/proc/{parent}/comm").read_text().strip()
        except OSError:
            return
        if name in ("make", "gmake") and not signal_on_parent_death(signal.SIGTERM, parent):
            self._stop_signal = signal.SIGTERM  # make is already gone

    def _on_signal(self, signum, frame) -> None:
        # Only note it: the main loop stops everything in order (a second signal changes nothing).
        if self._stop_signal is None:
            self._stop_signal = signum

    def say(self, message: str) -> None:
        line = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} serve: {message}"
        self.stdout.write(line)
        self.stdout.flush()
        self._log_file.write(line + "\n")
        self._log_file.flush()

    def _lock(self, path: Path) -> IO[str]:
        """One serve per var dir: a second one would fight the first over its processes."""
        handle = path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise CommandError(f"another `serve` is running with {path.parent}; stop it first")
        return handle

    def _wait_for(self, url: str, supervisor: Supervisor, timeout: float = 60) -> bool:
        """True once the web server answers (any HTTP status: /healthz may say a sweep is stale)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._stop_signal is None:
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=2).read()
                return True
            except urllib.error.HTTPError:
                return True
            except OSError:
                supervisor.poll()
                time.sleep(0.3)
        if self._stop_signal is None:
            raise CommandError(f"the web server did not answer at {url} within {timeout:g} s (see its log)")
        return False
