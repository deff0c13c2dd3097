"""The first step of a job that has files: copy them onto the node, then become the job's command.

    python -I /path/to/agent/fetch.py [--user UID:GID] [--path DIR]... MANIFEST -- ARGV...
    python -m agent.fetch MANIFEST -- ARGV...

The agent writes MANIFEST (`<work dir>/whalezen-files.json`, agent/jobfiles.py) and puts this in
front of the job's argv, so the download runs in the job's own process, as the job user: a big
copy never stalls the agent's heartbeats, and a stop or the agent's death ends it like the job.
For each entry it resolves the destination under the job's HOME (agent/fetch_dest.py: no `..`, no
way out through a link), copies it (s3:// agent/fetch_s3.py, gs:// agent/fetch_gs.py, upload:
agent/fetch_upload.py), prints `whalezen: fetched SOURCE -> DESTINATION (N files, SIZE)`, and
finally execs ARGV. Any failure prints `whalezen: fetching files failed: SOURCE: REASON` on
stderr and exits 125: the job fails, its output tail says why, and its command never runs.

`--user`: for an image job under docker or rootful podman the runtime client (the ARGV) must run
as the agent, so this starts as the agent's user too; the fetch itself then runs in a child that
drops to the job user first (the files are the job's, and a root process must not write into a
folder the job controls), and the parent execs the runtime once the child succeeded.

`--path`: the agent's site-packages, for when the job user cannot run the agent's own Python (a
venv under /root, say) and the agent starts this with the system's python3 instead.

Run with -I: nothing from the job's environment (PYTHONPATH) or work dir is imported. The agent's
own folder goes on sys.path below; boto3 comes from the agent's site-packages.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    # Started as a script with -I: the agent's own folder, never the job's cwd, provides `agent`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.fetch_dest import FetchError, Fetched, human_size, make_dirs, resolve_destination

EXIT_FETCH_FAILED = 125  # as the shim's and docker's own failures: "the job's command never ran"
EXIT_EXEC_FAILED = 127
MAX_MANIFEST_BYTES = 1 << 20
SCHEMES = ("s3://", "gs://", "upload:")


def main(argv: list[str]) -> int:
    try:
        user, paths, manifest_path, command = _parse(argv)
    except ValueError as err:
        print(f"whalezen: fetch: {err}; usage: fetch.py [--user UID:GID] [--path DIR]... MANIFEST -- ARGV...",
              file=sys.stderr)
        return 2
    sys.path[:0] = paths  # the agent's site-packages (boto3) when this Python is not the agent's own
    try:
        manifest = load_manifest(manifest_path)
    except FetchError as err:
        return _failed(str(manifest_path), str(err))
    code = fetch_as(user, manifest) if user else fetch_all(manifest)
    if code != 0:
        return code
    sys.stdout.flush()
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"whalezen: cannot run {command[0]!r}: {err.strerror or err}", file=sys.stderr)
        return EXIT_EXEC_FAILED
    return EXIT_EXEC_FAILED  # not reached: execvp returns only by raising


def _parse(argv: list[str]) -> tuple[tuple[int, int] | None, list[str], Path, list[str]]:
    """(--user, --path folders, the manifest, the job's argv). No argparse: the caller is the agent."""
    if "--" not in argv:
        raise ValueError("no '--' before the job's command")
    sep = argv.index("--")
    head, command = argv[:sep], argv[sep + 1:]
    user, paths = None, []
    while len(head) >= 2 and head[0] in ("--user", "--path"):
        option, value, head = head[0], head[1], head[2:]
        if option == "--path":
            paths.append(value)
            continue
        uid, _, gid = value.partition(":")
        if not (uid.isdigit() and gid.isdigit()):
            raise ValueError(f"--user {value!r}: expected UID:GID")
        user = (int(uid), int(gid))
    if len(head) != 1 or not command:
        raise ValueError("expected one manifest and a command")
    return user, paths, Path(head[0]), command


def load_manifest(path: Path) -> dict[str, Any]:
    """The manifest, checked: {"server": URL, "home": DIR, "files": [{"source", "destination",
    "shown"?, "token"?}]}. Raises FetchError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # the folder is the job's: never through a link
        with os.fdopen(fd, "rb") as handle:
            text = handle.read(MAX_MANIFEST_BYTES + 1)
        if len(text) > MAX_MANIFEST_BYTES:
            raise ValueError("the file list is too large")
        data = json.loads(text or b"null")
    except (OSError, ValueError) as err:
        raise FetchError(f"cannot read the file list: {getattr(err, 'strerror', None) or err}") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not isinstance(data.get("home"), str) or not data["home"].startswith("/"):
        raise FetchError("the file list is malformed (no files, or no absolute home)")
    for entry in files:
        if not (isinstance(entry, dict) and isinstance(entry.get("source"), str)
                and isinstance(entry.get("destination"), str)):
            raise FetchError("the file list is malformed (an entry without source or destination)")
    return data


def fetch_all(manifest: dict[str, Any]) -> int:
    """Fetch every entry in order; 0, or EXIT_FETCH_FAILED after saying which one failed and why."""
    home = Path(manifest["home"])
    for entry in manifest["files"]:
        source, shown = entry["source"], entry.get("shown") or entry["destination"]
        try:
            result = fetch_one(entry, home=home, server=str(manifest.get("server") or ""))
        except FetchError as err:
            return _failed(source, str(err))
        except Exception as err:  # noqa: BLE001 - a library's surprise still fails the job with a reason
            return _failed(source, f"{type(err).__name__}: {err}")
        files = "1 file" if result.files == 1 else f"{result.files} files"
        print(f"whalezen: fetched {source} -> {shown} ({files}, {human_size(result.bytes)})", flush=True)
    return 0


def fetch_one(entry: dict[str, Any], *, home: Path, server: str) -> Fetched:
    source, destination = entry["source"], entry["destination"]
    target = resolve_destination(destination, home)
    if destination.endswith("/"):  # "into this folder", also for a single object
        make_dirs(target, home)
    if source.startswith("s3://"):
        from agent.fetch_s3 import fetch_s3

        return fetch_s3(source, target, home)
    if source.startswith("gs://"):
        from agent.fetch_gs import fetch_gs

        return fetch_gs(source, target, home)
    if source.startswith("upload:"):
        from agent.fetch_upload import UploadFetchError, fetch_upload

        try:
            return _as_fetched(fetch_upload(server, source, target, entry.get("token")), target)
        except UploadFetchError as err:
            raise FetchError(str(err)) from None
    raise FetchError(f"unsupported source (expected one of {', '.join(SCHEMES)})")


def _as_fetched(result: Any, target: Path) -> Fetched:
    """What fetch_upload returned, as counts; counted on disk when it returned none."""
    if isinstance(result, Fetched):
        return result
    if hasattr(result, "files") and hasattr(result, "bytes"):
        return Fetched(files=int(result.files), bytes=int(result.bytes))
    if isinstance(result, tuple) and len(result) == 2:
        return Fetched(files=int(result[0]), bytes=int(result[1]))
    if target.is_file():
        return Fetched(files=1, bytes=target.stat().st_size)
    files = [p for p in target.rglob("*") if p.is_file() and not p.is_symlink()]
    return Fetched(files=len(files), bytes=sum(p.stat().st_size for p in files))


def fetch_as(user: tuple[int, int], manifest: dict[str, Any]) -> int:
    """fetch_all in a child that is the job user; its exit code (the child said what failed)."""
    uid, gid = user
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        code = EXIT_FETCH_FAILED
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            # The agent's HOME (its ~/.aws, ~/.config/gcloud) is not the job user's to read.
            os.environ["HOME"] = manifest["home"]
            code = fetch_all(manifest)
        except OSError as err:
            _failed("(all files)", f"cannot become uid {uid}: {err.strerror or err}")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):  # stopped while fetching: end the same way, so the agent sees the signal
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.waitstatus_to_exitcode(status)


def _failed(source: str, reason: str) -> int:
    print(f"whalezen: fetching files failed: {source}: {reason}", file=sys.stderr, flush=True)
    return EXIT_FETCH_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
