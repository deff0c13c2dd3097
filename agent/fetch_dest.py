"""Where a job's fetched files go, and what a fetch reports: shared by agent/fetch.py and its fetchers.

Every path a fetch writes is checked to lie under the job's HOME (its work dir): a destination with a
`..` component, or one that reaches outside through a symbolic link (one the job left in its work dir
on an earlier run, or one in the job user's home), is refused, and so is an object key from a bucket
that would do the same inside a tree. Files are written to a temporary name in their folder and
renamed into place, so a failed download never leaves half a file under the name the job reads, and
the rename replaces a link at that name instead of writing through it.

Standard library only: this runs as the job user, before the job's own command.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


class FetchError(Exception):
    """A reason one entry could not be fetched, in words for the job's owner."""


@dataclass(frozen=True)
class Fetched:
    files: int
    bytes: int


def resolve_destination(destination: str, home: Path) -> Path:
    """`~`, `~/x`, a relative `x` (both under `home`), or an absolute path that lies under `home`
    (the agent rewrites an image job's absolute destinations to such host paths). Raises FetchError."""
    if not destination or "\x00" in destination:
        raise FetchError("the destination is empty")
    if destination == "~" or destination.startswith("~/"):
        relative = destination[2:]
    elif destination.startswith("~"):
        raise FetchError(f"destination {destination!r}: only ~/ (the job's home) is supported, not ~user")
    else:
        relative = destination
    if ".." in relative.split("/"):
        raise FetchError(f"destination {destination!r} must not contain '..'")
    target = Path(os.path.normpath(home / relative))  # an absolute `relative` replaces home: checked below
    inside(target, home, what=f"destination {destination!r}")
    return target


def inside(path: Path, home: Path, *, what: str) -> Path:
    """`path` itself, once its real location (links followed, as far as it exists) is under `home`."""
    root = os.path.realpath(home)
    real = os.path.realpath(path)
    if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
        raise FetchError(f"{what} lies outside the job's home {home} (through '..' or a symbolic link)")
    return path


def tree_path(root: Path, relative: str, home: Path) -> Path:
    """Where the object `relative` (its key less the tree's prefix) goes under `root`. A key whose
    parts are empty, `.` or `..` (nothing S3 or GCS forbids) is refused, never written elsewhere."""
    parts = relative.split("/")
    if "\x00" in relative or any(p in ("", ".", "..") for p in parts):
        raise FetchError(f"object {relative!r} has no safe file name under the destination")
    return inside(root.joinpath(*parts), home, what=f"object {relative!r}")


def make_dirs(folder: Path, home: Path) -> None:
    """mkdir -p, then check that no link on the way led outside `home`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise FetchError(f"{folder} exists and is not a folder") from None
    except OSError as err:
        raise FetchError(f"cannot create {folder}: {err.strerror or err}") from None
    inside(folder, home, what=str(folder))


@contextmanager
def atomic_file(target: Path, home: Path) -> Iterator[str]:
    """A temporary file's name beside `target`; renamed onto `target` when the block succeeds,
    removed when it fails."""
    make_dirs(target.parent, home)
    if target.is_dir() and not target.is_symlink():
        raise FetchError(f"{target} is a folder; cannot write a file there")
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".whalezen-part-")
    except OSError as err:
        raise FetchError(f"cannot write in {target.parent}: {err.strerror or err}") from None
    os.close(fd)
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError as err:
            raise FetchError(f"cannot write {target}: {err.strerror or err}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def human_size(count: int) -> str:
    """Decimal units, one decimal: what `ls -lh --si` and cloud consoles show."""
    size = float(count)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")
