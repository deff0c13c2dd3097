"""What one small hostile request costs the real web server: the YAML alias bomb of issue 8.

Starts the web server `make run` starts (`broker.ops.web.web_command`, on a fresh SQLite database with the
demo data in a temporary folder), sends the bomb (anchors a0..a7, each a list of nine aliases of the
previous, used as one field's value) to the anonymous `/api/v1/agent/register` (with an invalid join
token, as `hostname`) and to `POST /api/v1/jobs/` (with a demo token, as `resources.interconnect`),
and prints each answer's status, size and time and how much the server's memory grew.

    .venv/bin/python -m bench.hostile_input [--runs 3] [--json]

The last line with --json is one JSON object: {"register": R, "jobs": R} where R is {"bytes_sent",
"status", "response_bytes", "seconds" (median), "rss_growth_mb" (growth of the server process and its
children over that route's runs)}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.procs import free_port
from broker.ops.web import web_command

ROOT = Path(__file__).resolve().parents[1]


def _anchors(levels: int, width: int) -> list[str]:
    lines = ["x0: &a0 [" + ",".join(["lol"] * width) + "]"]
    for level in range(1, levels):
        lines.append(f"x{level}: &a{level} [" + ",".join([f"*a{level - 1}"] * width) + "]")
    return lines


def alias_bomb(levels: int = 8, width: int = 9) -> bytes:
    """An agent registration: `&a0 [x, ...]`, then `&aN [*aN-1, ...]` nine times each; the last
    anchor is `hostname`'s value. 490 bytes at the default size."""
    lines = ["join_token: wzj_deadbeef_" + "0" * 40, "name: bomb", "agent_key: abcdefgh12", "gpus: []",
             *_anchors(levels, width), f"hostname: *a{levels - 1}"]
    return ("\n".join(lines) + "\n").encode()


def job_alias_bomb(levels: int = 8, width: int = 9) -> bytes:
    """A job spec whose `resources.interconnect` is the last anchor (a value the API used to echo)."""
    lines = ["name: bomb", "command: [python, train.py]", *_anchors(levels, width),
             f"resources: {{gpus: 1, interconnect: *a{levels - 1}}}"]
    return ("\n".join(lines) + "\n").encode()


def _own_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def _rss_mb(pid: int) -> float:
    """Resident memory of the server: its process and every descendant (gunicorn's worker is a
    child of its arbiter, and it is the worker that parses requests)."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += _own_rss_mb(current)
        todo += _children(current)
    return total


def _wait_up(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{base}/healthz", timeout=2).read()
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("the web server did not come up")


def _send(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> tuple[object, int, float]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/yaml", **headers})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, payload = err.code, err.read()
    except (TimeoutError, OSError):
        status, payload = "timeout", b""
    return status, len(payload), time.perf_counter() - start


def measure(runs: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as var:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(WHALEZEN_VAR_DIR=var, DJANGO_SETTINGS_MODULE="broker.settings")
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
        seeded = subprocess.run([sys.executable, "manage.py", "seed_demo"], cwd=ROOT, env=env, check=True,
                                capture_output=True, text=True).stdout
        token = next(line.split()[2] for line in seeded.splitlines() if line.startswith("TOKEN acme "))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(web_command(host="127.0.0.1", port=port),
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        routes = {"register": (f"{base}/api/v1/agent/register", alias_bomb(), {}),
                  "jobs": (f"{base}/api/v1/jobs/", job_alias_bomb(), {"Authorization": f"Bearer {token}"})}
        result = {}
        try:
            _wait_up(base)
            for name, (url, body, headers) in routes.items():
                rss_before = _rss_mb(server.pid)
                answers = [_send(url, body, headers, timeout_s) for _ in range(runs)]
                result[name] = {"bytes_sent": len(body), "status": answers[-1][0], "response_bytes": answers[-1][1],
                                "seconds": round(statistics.median(a[2] for a in answers), 4),
                                "rss_growth_mb": round(_rss_mb(server.pid) - rss_before, 1)}
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one answer")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.runs, args.timeout)
    if args.json:
        print(json.dumps(result))
    else:
        for route, figures in result.items():
            print(route, " ".join(f"{key}={value}" for key, value in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
