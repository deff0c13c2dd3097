"""Job commands for tests: small Python programs run by the agent as real processes.

Jobs run as the default job user (`nobody` here: the tests run as root), so their interpreter
must be one that user can execute: this venv's Python may live under a home directory that is
closed to it (/root is 0700).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from agent.isolation import can_reach, resolve_job_user


def _python_for_jobs() -> str:
    user = resolve_job_user(None)
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if candidate and can_reach(Path(os.path.realpath(candidate)), user, need=os.X_OK):
            return candidate
    raise RuntimeError(f"no Python interpreter that the job user {user.name} can run")


PY = _python_for_jobs()

# Writes its environment to env.json in its working directory, then exits with code $EXIT_CODE.
WRITE_ENV = [PY, "-c", (
    "import json, os, sys\n"
    "json.dump(dict(os.environ), open('env.json', 'w'))\n"
    "sys.exit(int(os.environ.get('EXIT_CODE', '0')))\n"
)]

# Installs a SIGUSR1 handler, says it is ready, then on a checkpoint request copies the request
# file to checkpoint-done.json and exits 0. Waits at most 30 s so a broken test cannot hang.
CHECKPOINTABLE = [PY, "-c", (
    "import json, os, signal, sys, time\n"
    "def on_usr1(signum, frame):\n"
    "    req = json.load(open(os.environ['WHALEZEN_CHECKPOINT_REQUEST_FILE']))\n"
    "    json.dump(req, open('checkpoint-done.json', 'w'))\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGUSR1, on_usr1)\n"
    "open('ready', 'w').close()\n"
    "deadline = time.time() + 30\n"
    "while time.time() < deadline: time.sleep(0.02)\n"
    "sys.exit(3)\n"
)]

# Runs until stopped; says it is ready first. Exits 0 on SIGTERM (a polite job).
SLEEPER = [PY, "-c", (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))\n"
    "open('ready', 'w').close()\n"
    "deadline = time.time() + 30\n"
    "while time.time() < deadline: time.sleep(0.02)\n"
)]

# Ignores SIGTERM: only SIGKILL ends it.
STUBBORN = [PY, "-c", (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "open('ready', 'w').close()\n"
    "deadline = time.time() + 30\n"
    "while time.time() < deadline: time.sleep(0.02)\n"
)]

# Uses the real checkpoint helper (agent/checkpoint) from this checkout: writes what it restored
# (WHALEZEN_RESTORE_FROM honoured) to `restored`, then saves $SAVES checkpoints at steps 10, 20,
# ...; before each save after the first it waits for a file `go-<n>` from the test, so the test
# decides when the next notice replaces the last one. Exits right after its last save (as a job
# about to be preempted does), or sleeps on with LINGER=1.
CHECKPOINTING = [PY, "-c", (
    "import os, sys, time\n"
    f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
    "from agent import checkpoint\n"
    "ckpt = checkpoint.Checkpointer()\n"
    "restored = ckpt.restore()\n"
    "open('restored', 'w').write(str(restored.step if restored else None))\n"
    "for n in range(1, int(os.environ.get('SAVES', '3')) + 1):\n"
    "    deadline = time.time() + 30\n"
    "    while n > 1 and not os.path.exists(f'go-{n}'):\n"
    "        if time.time() > deadline: sys.exit(3)\n"
    "        time.sleep(0.02)\n"
    "    ckpt.save(n * 10, f'state-{n}'.encode())\n"
    "deadline = time.time() + 30\n"
    "while os.environ.get('LINGER') and time.time() < deadline: time.sleep(0.02)\n"
)]
