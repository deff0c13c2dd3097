"""The checkpoint manifest: its format, how it is built and how measured files are held to it.

Pure: no I/O here, so the broker and the job read the same rules. A checkpoint directory is
`step-<step:012d>/` holding the data files and `manifest.json`; the manifest is written last, so
its presence is what says "every file listed here was written completely before me".
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# Zero-padded so a plain listing sorts by step; more digits are accepted for steps past 10**12.
_STEP_DIR = re.compile(r"^step-(\d{12,})$")
MAX_NAME_LENGTH = 1024


class ManifestError(ValueError):
    """A manifest that cannot be trusted: not JSON, a field missing or of the wrong type, a bad name."""


class UnsafeName(ValueError):
    """A file name that could escape the checkpoint directory (absolute, `..`, NUL, ...)."""


def step_dir_name(step: int) -> str:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number >= 0, not {step!r}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None for anything that is not a checkpoint dir."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def check_name(name: Any) -> str:
    """Return `name` if it is a plain relative name inside a checkpoint dir; raise UnsafeName if not.

    Sub-folders are allowed ("model/shard-0.pt") but only with forward slashes and no empty, `.`
    or `..` segment, so joining the name to any directory can never leave that directory. Backslashes
    are refused too: harmless on Linux, but a path separator to anyone who copies the files to Windows.
    """
    if not isinstance(name, str) or not name:
        raise UnsafeName(f"a checkpoint file name must be a non-empty string, not {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise UnsafeName(f"checkpoint file name longer than {MAX_NAME_LENGTH} characters")
    if "\x00" in name or "\\" in name:
        raise UnsafeName(f"checkpoint file name {name!r} contains NUL or a backslash")
    if name.startswith("/"):
        raise UnsafeName(f"checkpoint file name {name!r} is absolute")
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            raise UnsafeName(f"checkpoint file name {name!r} has an empty, '.' or '..' segment")
    if name == MANIFEST_NAME:
        raise UnsafeName(f"{MANIFEST_NAME!r} is the helper's own file")
    return name


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    step: int
    files: tuple[FileEntry, ...]
    job_id: str | None = None
    epoch: int | None = None
    created_at: float = 0.0
    request_id: str | None = None
    format: int = FORMAT_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)  # the author's own small metadata

    def file(self, name: str) -> FileEntry:
        for entry in self.files:
            if entry.name == name:
                return entry
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.files]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "job_id": self.job_id,
            "epoch": self.epoch,
            "step": self.step,
            "created_at": self.created_at,
            "request_id": self.request_id,
            "files": [entry.to_json() for entry in self.files],
            "extra": dict(self.extra),
        }

    def to_bytes(self) -> bytes:
        # Sorted keys: the same manifest always has the same bytes, hence the same sha256 in the notice.
        return (json.dumps(self.to_json(), sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Manifest":
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise ManifestError(f"manifest is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise ManifestError("manifest is not a JSON object")
        version = data.get("format")
        if version != FORMAT_VERSION:
            raise ManifestError(f"manifest format {version!r} is not {FORMAT_VERSION} "
                                "(written by a newer helper?)")
        step = data.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ManifestError(f"manifest step {step!r} is not a whole number >= 0")
        files = data.get("files")
        if not isinstance(files, list) or not files:
            raise ManifestError("manifest lists no files")
        entries = tuple(_entry_from_json(item) for item in files)
        if len({e.name for e in entries}) != len(entries):
            raise ManifestError("manifest lists a file twice")
        epoch = data.get("epoch")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
            raise ManifestError("manifest epoch is not a whole number")
        created_at = data.get("created_at", 0.0)
        if isinstance(created_at, bool) or not isinstance(created_at, (int, float)):
            raise ManifestError("manifest created_at is not a number")
        extra = data.get("extra") or {}
        if not isinstance(extra, dict):
            raise ManifestError("manifest extra is not an object")
        return cls(
            step=step,
            files=entries,
            job_id=_optional_str(data.get("job_id"), "job_id"),
            epoch=epoch,
            created_at=float(created_at),
            request_id=_optional_str(data.get("request_id"), "request_id"),
            extra=extra,
        )


def _optional_str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ManifestError(f"manifest {what} is not a string")


def _entry_from_json(item: Any) -> FileEntry:
    if not isinstance(item, dict):
        raise ManifestError("manifest file entry is not an object")
    try:
        name = check_name(item.get("name"))
    except UnsafeName as err:
        raise ManifestError(str(err)) from None
    size = item.get("size")
    digest = item.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ManifestError(f"manifest size of {name!r} is not a whole number >= 0")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ManifestError(f"manifest sha256 of {name!r} is not 64 lowercase hex digits")
    return FileEntry(name=name, size=size, sha256=digest)


def build_manifest(
    *, step: int, files: Iterable[FileEntry], job_id: str | None, epoch: int | None, created_at: float,
    request_id: str | None, extra: Mapping[str, Any] | None = None,
) -> Manifest:
    step_dir_name(step)  # the same rule as the directory, raised before anything is written
    entries = tuple(sorted(files, key=lambda e: e.name))
    if not entries:
        raise ValueError("a checkpoint needs at least one file")
    for entry in entries:
        check_name(entry.name)
    if len({e.name for e in entries}) != len(entries):
        raise ValueError("two checkpoint files have the same name")
    return Manifest(step=step, files=entries, job_id=job_id, epoch=epoch, created_at=created_at,
                    request_id=request_id, extra=dict(extra or {}))


@dataclass(frozen=True)
class Measured:
    """What was actually read back for one file: its size and sha256, or why it could not be read."""

    size: int | None = None
    sha256: str | None = None
    error: str | None = None


def problems_against(manifest: Manifest, measured: Mapping[str, Measured]) -> list[str]:
    """One line per file that is missing, unreadable, or of another size or content than listed."""
    problems = []
    for entry in manifest.files:
        found = measured.get(entry.name)
        if found is None or found.error is not None:
            problems.append(f"{entry.name}: {found.error if found else 'not read'}")
        elif found.size != entry.size:
            problems.append(f"{entry.name}: size {found.size} bytes, manifest says {entry.size}")
        elif found.sha256 != entry.sha256:
            problems.append(f"{entry.name}: sha256 {found.sha256} does not match "
                            f"the manifest's {entry.sha256}")
    return problems


class Hasher:
    """Size and sha256 of a stream, fed chunk by chunk as it is written or read."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.size = 0

    def update(self, chunk: bytes) -> None:
        self._sha.update(chunk)
        self.size += len(chunk)

    @property
    def hexdigest(self) -> str:
        return self._sha.hexdigest()

    def entry(self, name: str) -> FileEntry:
        return FileEntry(name=name, size=self.size, sha256=self.hexdigest)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
