"""The `upload:<id>` source of a job's files: download the archive from the broker and unpack it safely.

Called by agent/fetch.py inside the job's own process (as the job user), before the job's command:
`fetch_upload(server, source, destination, token)`. Standard library only (the fetch step runs with
the agent's interpreter, `-I`).

- GET `<server>/api/v1/agent/uploads/<id>` with `Authorization: Upload <token>` (the token of the
  job's assignment: that one upload, for that job). Redirects are not followed (the token would go
  along). Connection failures, timeouts and 5xx are retried with backoff; 403 and 404 are not: they
  will not change.
- The archive goes to a temporary file next to the destination (never memory), checked against the
  `Content-Length` and `X-Content-SHA256` the broker sends.
- Unpacking trusts nothing the broker checked: members must be regular files or folders with
  relative names, no '..', no links or devices, at most `MAX_MEMBERS` of them and no more bytes than
  the broker declared (`X-WhaleZen-Unpacked-Bytes`, else `MAX_UNPACKED_BYTES`); every target must
  resolve inside the destination (an existing symlink there cannot lead out). Python's `data` tar
  filter is applied on top where the interpreter has it (3.11.4+, 3.12).
- Kind `tree` (a folder) is unpacked into the destination folder; kind `file` writes its one file at
  the destination path itself.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import socket
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from agent.backoff import Backoff

UPLOAD_SOURCE = re.compile(r"^upload:([0-9a-f]{32})$")
MAX_MEMBERS = 20_000
MAX_UNPACKED_BYTES = 16 * 1024 ** 3  # when the broker declares nothing
MAX_DOWNLOAD_BYTES = 4 * 1024 ** 3  # when the broker sends no Content-Length
CHUNK_BYTES = 1024 * 1024
TIMEOUT_S = 60.0
ATTEMPTS = 4
USER_AGENT = "whalezen-agent-fetch"


class UploadFetchError(Exception):
    """Why an upload could not be fetched or unpacked (agent/fetch.py prints it and exits 125)."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # urllib then raises the 3xx as an HTTPError


_OPENER = urllib.request.build_opener(_NoRedirects)


class _Retry(Exception):
    pass


def fetch_upload(server: str, source: str, destination: Path, token: str, *,
                 sleep: Callable[[float], None] = time.sleep, attempts: int = ATTEMPTS,
                 timeout_s: float = TIMEOUT_S) -> tuple[int, int]:
    """Download upload `source` ("upload:<id>") from `server` and unpack it at `destination`; (files,
    bytes) unpacked."""
    match = UPLOAD_SOURCE.match(source)
    if not match:
        raise UploadFetchError(f"{source[:80]!r} is not an upload:<32 hex digits> source")
    if not token:
        raise UploadFetchError("the assignment carries no download token for it")
    url = f"{server.rstrip('/')}/api/v1/agent/uploads/{match.group(1)}"
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    backoff = Backoff(base_s=1.0, cap_s=15.0)
    with tempfile.TemporaryDirectory(prefix=".whalezen-upload-", dir=destination.parent) as scratch:
        archive = Path(scratch) / "upload.tar.gz"
        for attempt in range(attempts):
            try:
                headers = _download(url, token, archive, timeout_s)
                break
            except _Retry as exc:
                if attempt == attempts - 1:
                    raise UploadFetchError(f"{exc} (gave up after {attempts} tries)") from None
                sleep(backoff.next_delay())
        kind = headers.get("X-WhaleZen-Upload-Kind") or "tree"
        declared = headers.get("X-WhaleZen-Unpacked-Bytes") or ""
        limit = int(declared) if declared.isdigit() else MAX_UNPACKED_BYTES
        return unpack(archive, destination, kind=kind, max_unpacked=min(limit, MAX_UNPACKED_BYTES))


def _download(url: str, token: str, target: Path, timeout_s: float) -> dict[str, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Upload {token}", "User-Agent": USER_AGENT,
                                                   "Accept": "application/gzip, application/json;q=0.5"})
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            headers = {k: v for k, v in response.headers.items()}
            _save(response, target, headers)
            return headers
    except urllib.error.HTTPError as err:
        if err.code == 403:
            raise UploadFetchError("the broker refused the download token (HTTP 403: expired, or not for "
                                   "this upload)") from None
        if err.code == 404:
            raise UploadFetchError("the broker has no such upload (HTTP 404: deleted, or expired)") from None
        if err.code >= 500 or err.code == 429:
            raise _Retry(f"the broker answered HTTP {err.code}") from None
        raise UploadFetchError(f"the broker answered HTTP {err.code}") from None
    except (TimeoutError, socket.timeout):
        raise _Retry(f"no answer from {url} within {timeout_s:g} s") from None
    except http.client.HTTPException as exc:  # IncompleteRead, a connection dropped mid-answer
        raise _Retry(f"the download broke off: {type(exc).__name__}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise _Retry(f"cannot reach the broker: {getattr(exc, 'reason', None) or exc}") from None


def _save(response, target: Path, headers: dict[str, str]) -> None:
    length_text = headers.get("Content-Length") or ""
    expected = int(length_text) if length_text.isdigit() else None
    cap = expected if expected is not None else MAX_DOWNLOAD_BYTES
    digest = hashlib.sha256()
    size = 0
    try:
        out = open(target, "wb")
    except OSError as exc:
        raise UploadFetchError(f"cannot write the download next to the destination: {exc.strerror or exc}") from None
    with out:
        while chunk := response.read(CHUNK_BYTES):
            size += len(chunk)
            if size > cap:
                raise UploadFetchError(f"the download is larger than {cap} bytes")
            digest.update(chunk)
            try:
                out.write(chunk)
            except OSError as exc:  # a full disk will not empty itself between tries
                raise UploadFetchError(f"cannot write the download: {exc.strerror or exc}") from None
    if expected is not None and size != expected:
        raise _Retry(f"the download was cut short ({size} of {expected} bytes)")
    declared = (headers.get("X-Content-SHA256") or "").lower()
    if declared and declared != digest.hexdigest():
        raise _Retry("the download does not match its SHA-256 (changed on the way)")


# -- unpacking -----------------------------------------------------------------------------------------
def _member_problem(member: tarfile.TarInfo) -> str | None:
    name = member.name
    if name.startswith("/") or "\x00" in name:
        return "has an absolute name"
    if ".." in PurePosixPath(name).parts:
        return "has a '..' segment"
    if member.issym() or member.islnk():
        return "is a link"
    if member.isdir():
        return None
    if not member.isreg() or member.issparse():
        return "is not a regular file or folder"
    return None


def _inside(root: Path, target: Path) -> bool:
    return target == root or root in target.parents


def _checked_members(archive: tarfile.TarFile, root: Path, *, max_unpacked: int) -> list[tarfile.TarInfo]:
    members: list[tarfile.TarInfo] = []
    unpacked = 0
    while (member := archive.next()) is not None:
        if len(members) >= MAX_MEMBERS:
            raise UploadFetchError(f"the archive holds more than {MAX_MEMBERS} entries")
        problem = _member_problem(member)
        if problem:
            raise UploadFetchError(f"archive member {member.name[:120]!r} {problem}; nothing was unpacked")
        unpacked += member.size if member.isreg() else 0
        if unpacked > max_unpacked:
            raise UploadFetchError(f"the archive unpacks to more than {max_unpacked} bytes; nothing was unpacked")
        # Through any symlink already there: the target must stay inside the destination.
        if not _inside(root, Path(os.path.realpath(root / member.name))):
            raise UploadFetchError(f"archive member {member.name[:120]!r} would land outside the destination")
        members.append(member)
    return members


def unpack(archive_path: Path, destination: Path, *, kind: str = "tree", max_unpacked: int = MAX_UNPACKED_BYTES
           ) -> tuple[int, int]:
    """Unpack a checked archive at `destination` (a folder for kind tree, the file itself for kind file);
    (files, bytes) written."""
    try:
        with tarfile.open(archive_path, mode="r:gz") as archive:
            if kind == "file":
                return _unpack_file(archive, destination, max_unpacked=max_unpacked)
            if kind != "tree":
                raise UploadFetchError(f"unknown upload kind {kind[:20]!r}")
            if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
                raise UploadFetchError(f"{destination} exists and is not a folder")
            destination.mkdir(parents=True, exist_ok=True)
            root = Path(os.path.realpath(destination))
            members = _checked_members(archive, root, max_unpacked=max_unpacked)
            if hasattr(tarfile, "data_filter"):
                archive.extractall(root, members=members, filter="data")
            else:  # pragma: no cover - Python before 3.11.4: the checks above are the guard
                archive.extractall(root, members=members)
            regular = [m for m in members if m.isreg()]
            return len(regular), sum(m.size for m in regular)
    except UploadFetchError:
        raise
    except tarfile.FilterError as exc:
        raise UploadFetchError(f"refused by the tar data filter: {exc}") from None
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise UploadFetchError(f"the archive is damaged: {exc or type(exc).__name__}") from None
    except OSError as exc:
        raise UploadFetchError(f"cannot unpack into {destination}: {exc.strerror or exc}") from None


def _unpack_file(archive: tarfile.TarFile, destination: Path, *, max_unpacked: int) -> tuple[int, int]:
    root = Path(os.path.realpath(destination.parent))
    members = _checked_members(archive, root, max_unpacked=max_unpacked)
    regular = [m for m in members if m.isreg()]
    if len(regular) != 1 or len(members) != 1:
        raise UploadFetchError("an upload of one file must hold exactly one regular file")
    if destination.is_dir() and not destination.is_symlink():
        raise UploadFetchError(f"{destination} is a folder, and this upload is one file")
    source = archive.extractfile(regular[0])
    assert source is not None
    fd, temp = tempfile.mkstemp(prefix=".whalezen-", dir=root)
    try:
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(source, out, CHUNK_BYTES)
        os.chmod(temp, 0o755 if regular[0].mode & 0o111 else 0o644)
        os.replace(temp, root / destination.name)  # replaces a symlink there itself, never its target
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return 1, regular[0].size
