"""The embedded default's files are closed to jobs: on a `make run` machine the demo nodes' jobs run
on the same host as another user (nobody / whalezen-job), and the SQLite file holds every tenant's
jobs and their env. A process of that user can neither read the database nor list the var dir."""
from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _as_nobody(argv: list[str]) -> subprocess.CompletedProcess:
    nobody = pwd.getpwnam("nobody")
    return subprocess.run(argv, user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], capture_output=True,
                          text=True, timeout=30, cwd="/")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_job_user_cannot_read_the_database_nor_list_the_var_dir(tmp_path):
    var = tmp_path / "var"
    tmp_path.chmod(0o755)  # only our own modes may keep the other user out
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["WHALEZEN_VAR_DIR"] = str(var)
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True,
                   timeout=120)
    database = var / "whalezen.sqlite3"
    assert database.exists()
    for path in (database, Path(f"{database}-wal"), Path(f"{database}-shm")):
        if path.exists():
            assert path.stat().st_mode & 0o077 == 0, f"{path.name} is readable by others"
    assert _as_nobody(["/bin/cat", str(database)]).returncode != 0
    listing = _as_nobody(["/bin/ls", str(var)])
    assert listing.returncode != 0 and "whalezen.sqlite3" not in listing.stdout
