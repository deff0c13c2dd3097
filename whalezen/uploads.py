"""Local folders and files of a SkyPilot task, packed for upload by `whalezen submit`.

A task's `workdir` and the `file_mounts` whose source is a local path are packed into a tar.gz each,
uploaded (`POST /api/v1/uploads/`), and the task is rewritten to name the uploads (`upload:<id>`)
before it is submitted; the node copies them into place before `setup` runs.

- Paths are SkyPilot's: `~` is expanded, and a relative path is relative to the directory
  `whalezen submit` runs in (as it is to where `sky` is called), not to the task file.
- What is left out of a folder: `.git` always; then the patterns of a `.skyignore` at the folder's top,
  or, when there is none, of its top-level `.gitignore` (SkyPilot's order). Only that one file is
  read (no nested ignore files, no global excludes); its lines follow .gitignore's syntax: `#`
  comments, `!` to re-include, a trailing `/` for folders only, a leading or inner `/` anchors the
  pattern at the top, `*`, `?`, `[...]` and `**`.
- A symbolic link to a file is sent as the file it points to; a link to a folder, and anything that
  is not a regular file or folder (sockets, FIFOs), is left out and said so.
- Limits, checked here so the answer comes before anything is sent: at most `max_bytes` packed
  (`WHALEZEN_MAX_UPLOAD_BYTES`, default 64 MiB, the server's default), `UNPACK_FACTOR` times that
  unpacked, `MAX_MEMBERS` files and folders.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import re
import stat
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
UNPACK_FACTOR = 4
MAX_MEMBERS = 20_000
UPLOAD_SOURCE = re.compile(r"^upload:[0-9a-f]{32}$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")
ALWAYS_SKIPPED = frozenset({".git"})


class PackError(Exception):
    """A local source that cannot be sent (missing, too big); the CLI exits 2 with it."""


@dataclass
class LocalSource:
    """One local path of a task: `field` names it as the API's problems do (`workdir`,
    `file_mounts[<destination>]`)."""

    field: str
    given: str
    path: Path


@dataclass
class Packed:
    source: LocalSource
    archive: Path  # a temporary file: `discard()` it when done
    kind: str  # "tree" or "file"
    size_bytes: int
    sha256: str
    files: int
    unpacked_bytes: int
    skipped: list[str] = field(default_factory=list)

    def discard(self) -> None:
        self.archive.unlink(missing_ok=True)


def max_upload_bytes(env: Mapping[str, str]) -> int:
    text = env.get("WHALEZEN_MAX_UPLOAD_BYTES", "")
    return int(text) if text.isdigit() and int(text) > 0 else DEFAULT_MAX_BYTES


def is_local(source: Any) -> bool:
    return isinstance(source, str) and bool(source.strip()) and not UPLOAD_SOURCE.match(source.strip()) \
        and not _URL.match(source.strip())


def local_sources(spec: Mapping[str, Any], *, cwd: Path) -> list[LocalSource]:
    """The local paths of a SkyPilot task (none for other formats: they name uploads themselves)."""
    if "apiVersion" in spec or not ({"workdir", "file_mounts"} & set(spec)):
        return []
    found: list[LocalSource] = []
    if is_local(spec.get("workdir")):
        found.append(LocalSource("workdir", spec["workdir"], _resolve(spec["workdir"], cwd)))
    mounts = spec.get("file_mounts")
    if isinstance(mounts, Mapping):
        for destination, source in mounts.items():
            if isinstance(source, Mapping):
                source = source.get("source")
            if is_local(source):
                found.append(LocalSource(f"file_mounts[{destination}]", source, _resolve(source, cwd)))
    return found


def _resolve(given: str, cwd: Path) -> Path:
    path = Path(os.path.expanduser(given.strip()))
    return path if path.is_absolute() else cwd / path


def with_uploads(spec: Mapping[str, Any], ids: Mapping[str, str]) -> dict[str, Any]:
    """The task with each local source (by field) replaced by `upload:<id>`."""
    out = dict(spec)
    if "workdir" in ids:
        out["workdir"] = f"upload:{ids['workdir']}"
    mounts = out.get("file_mounts")
    if isinstance(mounts, Mapping):
        rewritten: dict[str, Any] = {}
        for destination, source in mounts.items():
            upload_id = ids.get(f"file_mounts[{destination}]")
            if upload_id is None:
                rewritten[destination] = source
            elif isinstance(source, Mapping):
                rewritten[destination] = {**source, "source": f"upload:{upload_id}"}
            else:
                rewritten[destination] = f"upload:{upload_id}"
        out["file_mounts"] = rewritten
    return out


# -- ignore patterns ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rule:
    negate: bool
    dir_only: bool
    regex: re.Pattern[str]


def _glob_regex(pattern: str, anchored: bool) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    prefix = "" if anchored else "(?:.*/)?"
    return re.compile(f"^{prefix}{''.join(out)}$")


def ignore_rules(text: str) -> list[_Rule]:
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        rules.append(_Rule(negate, dir_only, _glob_regex(line.lstrip("/"), anchored)))
    return rules


def ignored(relative: str, *, is_dir: bool, rules: list[_Rule]) -> bool:
    result = False
    for rule in rules:
        if rule.dir_only and not is_dir:
            continue
        if rule.regex.match(relative):
            result = not rule.negate
    return result


def rules_for(folder: Path) -> tuple[str | None, list[_Rule]]:
    for name in (".skyignore", ".gitignore"):
        path = folder / name
        if path.is_file():
            return name, ignore_rules(path.read_text(errors="replace"))
    return None, []


# -- packing -----------------------------------------------------------------------------------------
def _human(size: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def describe(packed: Packed) -> str:
    what = "1 file" if packed.kind == "file" else f"{packed.files} files"
    return f"{packed.source.field} {packed.source.given}: {what}, {_human(packed.unpacked_bytes)} " \
           f"({_human(packed.size_bytes)} packed)"


def pack(source: LocalSource, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Packed:
    """Pack a local folder (kind tree) or file (kind file) into a temporary tar.gz."""
    path = source.path
    if not path.exists():
        raise PackError(f"{source.field}: {source.given} does not exist (relative paths are relative to the "
                        f"directory whalezen submit runs in, as for sky)")
    if source.field == "workdir" and not path.is_dir():
        raise PackError(f"workdir: {source.given} is not a folder")
    fd, name = tempfile.mkstemp(prefix="whalezen-upload-", suffix=".tar.gz")
    archive = Path(name)
    state = _State(source=source, max_bytes=max_bytes)
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as zipped, \
                tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
            state.raw = raw
            if path.is_dir():
                kind = "tree"
                _pack_tree(tar, path, state)
            else:
                kind = "file"
                _add_file(tar, path, path.name, state)
        size = archive.stat().st_size
        if size > max_bytes:
            raise _too_big(source, size, max_bytes)
        digest = hashlib.sha256()
        with archive.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1024 * 1024), b""):
                digest.update(chunk)
        return Packed(source=source, archive=archive, kind=kind, size_bytes=size, sha256=digest.hexdigest(),
                      files=state.files, unpacked_bytes=state.unpacked, skipped=state.skipped)
    except BaseException:
        archive.unlink(missing_ok=True)
        raise


@dataclass
class _State:
    source: LocalSource
    max_bytes: int
    raw: Any = None
    files: int = 0
    members: int = 0
    unpacked: int = 0
    skipped: list[str] = field(default_factory=list)


def _too_big(source: LocalSource, size: int, limit: int) -> PackError:
    return PackError(f"{source.field}: {source.given} packs to more than {_human(limit)} ({_human(size)} so far), "
                     f"the most an upload may hold: list what need not be sent in .skyignore, or put large data "
                     f"in s3:// or gs:// and name it in file_mounts")


def _pack_tree(tar: tarfile.TarFile, root: Path, state: _State) -> None:
    _, rules = rules_for(root)
    for folder, dirs, files in os.walk(root, followlinks=False):
        here = Path(folder)
        relative_dir = here.relative_to(root).as_posix()
        prefix = "" if relative_dir == "." else relative_dir + "/"
        keep_dirs = []
        for name in sorted(dirs):
            relative = prefix + name
            if name in ALWAYS_SKIPPED or ignored(relative, is_dir=True, rules=rules):
                continue
            if (here / name).is_symlink():
                state.skipped.append(f"{relative} (a link to a folder)")
                continue
            keep_dirs.append(name)
            _count(state)
            info = tar.gettarinfo(here / name, arcname=relative)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info)
        dirs[:] = keep_dirs
        for name in sorted(files):
            relative = prefix + name
            if name in ALWAYS_SKIPPED or ignored(relative, is_dir=False, rules=rules):
                continue
            _add_file(tar, here / name, relative, state)


def _count(state: _State) -> None:
    state.members += 1
    if state.members > MAX_MEMBERS:
        raise PackError(f"{state.source.field}: {state.source.given} holds more than {MAX_MEMBERS} files and "
                        "folders, the most an upload may: list what need not be sent in .skyignore")


def _add_file(tar: tarfile.TarFile, path: Path, arcname: str, state: _State) -> None:
    try:
        info_stat = path.stat()  # follows a link: a link to a file is sent as that file
    except OSError:
        state.skipped.append(f"{arcname} (a broken link)")
        return
    if not stat.S_ISREG(info_stat.st_mode):
        state.skipped.append(f"{arcname} (not a regular file)")
        return
    _count(state)
    state.files += 1
    state.unpacked += info_stat.st_size
    if state.unpacked > UNPACK_FACTOR * state.max_bytes:
        raise PackError(f"{state.source.field}: {state.source.given} holds more than "
                        f"{_human(UNPACK_FACTOR * state.max_bytes)} of files, the most an upload may unpack to: "
                        "list what need not be sent in .skyignore, or put large data in s3:// or gs://")
    info = tarfile.TarInfo(arcname)
    info.size = info_stat.st_size
    info.mode = 0o755 if info_stat.st_mode & 0o111 else 0o644
    info.mtime = int(info_stat.st_mtime)
    with path.open("rb") as stream:
        tar.addfile(info, stream)
    if state.raw is not None and state.raw.tell() > state.max_bytes:  # stop packing as soon as it is too big
        raise _too_big(state.source, state.raw.tell(), state.max_bytes)
