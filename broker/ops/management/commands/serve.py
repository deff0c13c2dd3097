"""`manage.py serve`: the whole service on one machine (what `make run` starts).

Web server in the foreground; a Celery worker with its beat scheduler (file-system queue by default,
Redis with REDIS_URL); and, unless --no-agents, a node agent with fake GPUs for every simulated node.
Ctrl-C stops all of it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management.base import BaseCommand

from broker.ops.demo_agents import start_demo_agents, stop_simulated_cloud


class Command(BaseCommand):
    help = "Run web, worker + beat and the demo node agents until interrupted."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--no-agents", action="store_true", help="do not start the demo node agents")
        parser.add_argument("--no-worker", action="store_true", help="do not start the Celery worker")

    def handle(self, *args, **options):
        host, port = options["host"], options["port"]
        url = f"http://{host}:{port}"
        env = {**os.environ, "WHALEZEN_PUBLIC_URL": os.environ.get("WHALEZEN_PUBLIC_URL", url), "PORT": str(port)}
        log_dir = settings.VAR_DIR / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        children: list[subprocess.Popen] = []
        agents = []
        # `kill`/systemd send SIGTERM: stop everything as for Ctrl-C.
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            web = subprocess.Popen([sys.executable, "manage.py", "runserver", f"{host}:{port}", "--noreload"],
                                   env=env)
            children.append(web)
            if not options["no_worker"]:
                worker_log = open(log_dir / "worker.log", "ab")
                children.append(subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "broker", "worker", "-B", "--pool", "solo",
                     "--loglevel", "INFO", "-s", str(settings.VAR_DIR / "celerybeat-schedule")],
                    env=env, stdout=worker_log, stderr=subprocess.STDOUT))
                self.stdout.write(f"worker + beat started (log: {log_dir / 'worker.log'})")
            if not options["no_agents"]:
                self._wait_for(url)
                agents = start_demo_agents(server_url=url)
                self.stdout.write(f"{len(agents)} demo node agents started (logs under {settings.VAR_DIR}/demo-agents)")
            self.stdout.write(self.style.SUCCESS(f"WhaleZen is up at {url} (API docs: {url}/api/docs/). Ctrl-C stops."))
            while all(child.poll() is None for child in children):
                time.sleep(1)
            self.stderr.write("a service process exited; stopping the rest")
        except KeyboardInterrupt:
            pass
        finally:
            stop_simulated_cloud(log=self.stderr.write)
            for provider, ref in agents:
                try:
                    provider.terminate(ref)
                except Exception as exc:  # keep stopping the others
                    self.stderr.write(f"stopping agent {ref.instance_id}: {exc}")
            for child in children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in children:
                try:
                    child.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    child.kill()

    def _wait_for(self, url: str, timeout: float = 30) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=2).read()
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"the web server did not answer at {url}")
