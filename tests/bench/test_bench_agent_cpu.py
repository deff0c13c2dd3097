"""bench/agent_cpu.py measures CPU from /proc: a spinning process reads as busy, a sleeping one as idle."""
from __future__ import annotations

import subprocess
import sys

from bench.agent_cpu import window


def _started(code: str) -> subprocess.Popen:
    """A child that says it is ready before its loop, so the interpreter's start-up falls outside the window."""
    child = subprocess.Popen([sys.executable, "-c", f"print('ready', flush=True)\n{code}"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_window_tells_a_spinning_process_from_a_sleeping_one():
    spin = _started("while True: pass")
    sleep = _started("import time; time.sleep(60)")
    try:
        measured = window({spin.pid: "spin", sleep.pid: "sleep"}, 2.0)
    finally:
        spin.kill(), sleep.kill()
        spin.wait(), sleep.wait()
    assert measured["spin"] > 10  # a core when the machine is quiet; a share of one when it is not
    assert measured["sleep"] < 2
