"""The agent's side of a job's files: the assignment's list checked, the manifest, the fetch step.

The broker sends `files: [{source, destination, token?}]` (docs/job-spec.md). Nothing is fetched in
the agent's own loop: JobRunner.start writes `<work dir>/whalezen-files.json` and puts
agent/fetch.py in front of the job's argv, so the job's own process copies the files, as the job
user, before its command (and before SkyPilot's `setup`).

Destinations: `~/x` and relative `x` lie under the job's HOME (its work dir, unless the job user
has a home of its own). An absolute `/x` is for image jobs only: it is fetched on the host under
`<work dir>/whalezen-mounts/<n>` and bind-mounted at `/x` in the container (agent/runtimes.py).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import site
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.isolation import JobUser, can_reach

MANIFEST_FILE = "whalezen-files.json"
MOUNTS_DIR = "whalezen-mounts"
FETCH_SCRIPT = Path(__file__).resolve().with_name("fetch.py")  # absolute: the job starts in its own cwd
MAX_FILES = 64  # as the job spec allows
MAX_TEXT = 4096
FETCH_FAILED = "whalezen: fetching files failed: "  # agent/fetch.py's failure line
_UPLOAD = re.compile(r"upload:[0-9a-f]{32}")
_BUCKET = re.compile(r"(s3|gs)://[A-Za-z0-9][A-Za-z0-9._-]{1,220}(/.*)?", re.DOTALL)
# Where a bind mount would hide or replace what the container needs to run at all.
_SYSTEM_PATHS = ("/", "/proc", "/sys", "/dev", "/etc", "/bin", "/sbin", "/usr", "/lib", "/lib64")


@dataclass(frozen=True)
class JobFile:
    source: str
    destination: str
    token: str | None = None


@dataclass(frozen=True)
class Mount:
    host: Path
    container: str


def parse_files(data: Any, *, image: bool) -> tuple[JobFile, ...]:
    """The assignment's `files`, checked. Raises ValueError with the field and why."""
    if data is None:
        return ()
    if not isinstance(data, list) or len(data) > MAX_FILES:
        raise ValueError(f"files must be a list of at most {MAX_FILES} entries")
    out: list[JobFile] = []
    for n, entry in enumerate(data):
        where = f"files[{n}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object with source and destination")
        source, destination, token = entry.get("source"), entry.get("destination"), entry.get("token")
        if not (isinstance(source, str) and len(source) <= MAX_TEXT and "\x00" not in source
                and (_UPLOAD.fullmatch(source) or _BUCKET.fullmatch(source))):
            raise ValueError(f"{where}.source must be s3://bucket/..., gs://bucket/... or upload:<id>")
        if token is not None and not (isinstance(token, str) and 0 < len(token) <= MAX_TEXT and token.isprintable()):
            raise ValueError(f"{where}.token must be a non-empty string")
        out.append(JobFile(source=source, destination=_destination(destination, where, image=image), token=token))
    seen = [os.path.normpath(f.destination.replace("~/", "", 1)) for f in out]
    if len(set(seen)) != len(seen):
        raise ValueError("files lists the same destination twice")
    return tuple(out)


def _destination(value: Any, where: str, *, image: bool) -> str:
    if not (isinstance(value, str) and value.strip() and len(value) <= MAX_TEXT and "\x00" not in value):
        raise ValueError(f"{where}.destination must be a non-empty path")
    if ".." in value.split("/"):
        raise ValueError(f"{where}.destination must not contain '..'")
    if value.startswith("~") and not (value == "~" or value.startswith("~/")):
        raise ValueError(f"{where}.destination: only ~/ (the job's home) is supported, not ~user")
    if value.startswith("/"):
        if any(c in value for c in ":,"):  # the runtimes' mount syntax separates on them
            raise ValueError(f"{where}.destination: an absolute path cannot contain ':' or ','")
        if not image:
            raise ValueError(f"{where}.destination: an absolute path is for jobs with an image (bind-mounted "
                             "there); use ~/path or a relative path")
        if os.path.normpath(value) in _SYSTEM_PATHS:
            raise ValueError(f"{where}.destination {value!r} would hide the image's own {os.path.normpath(value)}")
    return value


def plan(files: tuple[JobFile, ...], *, workdir: Path) -> tuple[list[dict[str, Any]], list[Mount]]:
    """The manifest's entries, and the bind mounts an image job needs: an absolute destination is
    fetched to `<workdir>/whalezen-mounts/<n>` on the host and mounted at its own path."""
    entries: list[dict[str, Any]] = []
    mounts: list[Mount] = []
    for n, item in enumerate(files):
        entry: dict[str, Any] = {"source": item.source, "destination": item.destination}
        if item.destination.startswith("/"):
            host = workdir / MOUNTS_DIR / str(n)
            mounts.append(Mount(host=host, container=os.path.normpath(item.destination)))
            entry.update(destination=str(host) + ("/" if item.destination.endswith("/") else ""),
                         shown=item.destination)
        if item.token is not None:
            entry["token"] = item.token
        entries.append(entry)
    return entries, mounts


def write_manifest(workdir: Path, *, server: str, home: str, entries: list[dict[str, Any]],
                   uid: int | None, gid: int | None) -> Path:
    """`<workdir>/whalezen-files.json`, 0600, the job user's (it holds upload tokens for this job
    only). mkstemp + rename: never written through a link the job left at that name."""
    fd, tmp = tempfile.mkstemp(dir=workdir, prefix=".whalezen-files.")
    try:
        if uid is not None:
            os.fchown(fd, uid, gid if gid is not None else uid)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump({"server": server, "home": home, "files": entries}, handle)
        path = workdir / MANIFEST_FILE
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def with_fetch(argv: list[str], entries: list[dict[str, Any]], *, workdir: Path, home: str, server: str,
               user: JobUser, as_job_user: bool) -> list[str]:
    """The manifest written, and the argv that fetches it before `argv`. `as_job_user`: whether the
    shim runs the argv as the job user; when not (docker's client is the agent's), the fetch drops
    to the job user on its own. Raises ValueError (nothing the job user can run it with) or OSError."""
    separate = user if user.separate else None
    python = fetch_python(separate)  # one the job user can run, also where it starts as the agent
    if python is None or (separate is not None and not can_reach(FETCH_SCRIPT, separate, need=os.R_OK)):
        raise ValueError(f"the job has files to fetch, and the job user {user.name} cannot run {sys.executable} or "
                         f"any python3, or read {FETCH_SCRIPT} (a folder on the way is closed to it): install the "
                         "agent where that user can read it")
    try:
        manifest = write_manifest(workdir, server=server, home=home, entries=entries,
                                  uid=separate.uid if separate else None, gid=separate.gid if separate else None)
    except OSError as err:
        raise OSError(f"cannot write the job's file list: {err.strerror or err}") from None
    drop = (user.uid, user.gid) if separate is not None and not as_job_user else None
    return fetch_argv(manifest, argv, python=python, drop_to=drop)


def fetch_python(user: JobUser | None) -> str | None:
    """The Python that runs agent/fetch.py: the agent's own, else (the job user cannot reach it: a
    venv under /root, say) a system python3 that user can run; None when there is none."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and (user is None or can_reach(Path(os.path.realpath(candidate)), user, need=os.X_OK)):
            return candidate
    return None


def fetch_argv(manifest: Path, argv: list[str], *, python: str, drop_to: tuple[int, int] | None = None) -> list[str]:
    """agent/fetch.py in front of `argv`. -I keeps the job's PYTHONPATH and work dir out of what it
    imports; another Python than the agent's gets the agent's site-packages (boto3) with --path."""
    head = [python, "-I", str(FETCH_SCRIPT)]
    if drop_to is not None:
        head += ["--user", f"{drop_to[0]}:{drop_to[1]}"]
    if python != sys.executable:
        for folder in site.getsitepackages():
            head += ["--path", folder]
    return [*head, str(manifest), "--", *argv]


def fetch_failure(output_tail: str) -> str | None:
    """The reason agent/fetch.py gave, from the job's output, or None when it did not fail."""
    for line in reversed(output_tail.splitlines()):
        if line.startswith(FETCH_FAILED):
            return line[len(FETCH_FAILED):].strip()
    return None
