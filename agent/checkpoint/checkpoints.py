"""Reading checkpoints back: list, verify, restore and prune, from a plain URI with no job env.

This is the half the broker uses too (verify before it marks a checkpoint committed), so nothing
here reads WHALEZEN_* variables; agent/checkpoint/checkpointer.py is the job-side half.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.checkpoint.manifest import (
    MANIFEST_NAME,
    Hasher,
    Manifest,
    ManifestError,
    Measured,
    check_name,
    parse_step_dir,
    problems_against,
)
from agent.checkpoint.storage import Storage, open_storage


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    uri: str  # the checkpoint's own directory
    has_manifest: bool  # False: torn, or still being written


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    uri: str
    problems: tuple[str, ...]
    manifest: Manifest | None = None

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class PruneResult:
    kept: tuple[int, ...]
    deleted: tuple[int, ...]


@dataclass
class Restored:
    """A checkpoint that verified: its step, its manifest, and its files in a local directory.

    For a local checkpoint `directory` is the checkpoint itself (read it, do not write to it); for
    S3 it is a fresh folder the files were downloaded (and verified) into, removed by cleanup().
    """

    step: int
    manifest: Manifest
    uri: str
    directory: Path
    skipped: tuple[VerifyResult, ...] = ()  # newer checkpoints passed over, and why
    _owns_directory: bool = field(default=False, repr=False)

    @property
    def names(self) -> list[str]:
        return self.manifest.names

    def path(self, name: str) -> Path:
        check_name(name)
        self.manifest.file(name)  # KeyError for a name the checkpoint does not have
        return self.directory / name

    def read_bytes(self, name: str = "data") -> bytes:
        return self.path(name).read_bytes()

    @property
    def data(self) -> bytes:
        """The single blob saved with save(step, data=b"...")."""
        return self.read_bytes("data")

    def cleanup(self) -> None:
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "Restored":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


def list_checkpoints(uri: str | Storage, *, s3_client: Any = None) -> list[CheckpointInfo]:
    """Every `step-*` directory under `uri`, oldest first; nothing is verified here."""
    storage = _storage(uri, s3_client)
    infos = []
    for name in storage.list_dirs():
        step = parse_step_dir(name)
        if step is None:
            continue
        infos.append(CheckpointInfo(step=step, uri=storage.uri_of(name),
                                    has_manifest=storage.exists(f"{name}/{MANIFEST_NAME}")))
    return sorted(infos, key=lambda info: info.step)


def verify(checkpoint_uri: str, *, s3_client: Any = None) -> VerifyResult:
    """Re-read every file of one checkpoint directory and hold its size and sha256 to the manifest."""
    parent, name = _split_checkpoint_uri(checkpoint_uri)
    return verify_in(open_storage(parent, s3_client=s3_client), name)


def verify_in(storage: Storage, dir_name: str, *, download_to: Path | None = None) -> VerifyResult:
    """verify() for a directory of `storage`; with `download_to`, keep a copy of each file read there."""
    uri = storage.uri_of(dir_name)
    step = parse_step_dir(dir_name)
    if step is None:
        return VerifyResult(False, uri, (f"{dir_name!r} is not a step-<number> checkpoint directory",))
    try:
        manifest = Manifest.from_bytes(storage.read_bytes(f"{dir_name}/{MANIFEST_NAME}"))
    except FileNotFoundError:
        missing = f"{MANIFEST_NAME} missing: the write was torn or is still going on"
        return VerifyResult(False, uri, (missing,))
    except ManifestError as err:
        return VerifyResult(False, uri, (f"{MANIFEST_NAME}: {err}",))
    if manifest.step != step:
        return VerifyResult(False, uri, (f"{MANIFEST_NAME} says step {manifest.step}, the directory {step}",),
                            manifest)
    measured = {entry.name: _measure(storage, f"{dir_name}/{entry.name}", download_to, entry.name)
                for entry in manifest.files}
    problems = problems_against(manifest, measured)
    return VerifyResult(not problems, uri, tuple(problems), manifest)


def restore_from(
    uri: str | Storage, *, into: Path | None = None, s3_client: Any = None, below: int | None = None,
) -> Restored | None:
    """The newest checkpoint whose manifest is there and whose every file verifies, or None.
    With `below`, only checkpoints of a lower step are considered."""
    storage = _storage(uri, s3_client)
    skipped: list[VerifyResult] = []
    for info in reversed(list_checkpoints(storage)):
        if below is not None and info.step >= below:
            continue
        restored, result = _restore_dir(storage, _dir_of(info), info.step, into, tuple(skipped))
        if restored is not None:
            return restored
        skipped.append(result)
    return None


def restore_committed(
    committed_uri: str, *, into: Path | None = None, s3_client: Any = None,
    warn: Callable[[str], None] | None = None,
) -> Restored | None:
    """Restore exactly the checkpoint directory the broker committed (`WHALEZEN_RESTORE_FROM`).

    If it no longer verifies (storage corrupted since the broker checked it), fall back to the
    newest verified checkpoint of a lower step beside it, and warn naming both. Never a higher
    step: the broker never committed it, so another copy of the job may have written it, or it
    may answer a request the broker gave up on.
    """
    parent, name = _split_checkpoint_uri(committed_uri)
    step = parse_step_dir(name)
    if step is None:
        raise ValueError(f"committed checkpoint {committed_uri!r} is not a step-<number> directory")
    storage = open_storage(parent, s3_client=s3_client)
    restored, result = _restore_dir(storage, name, step, into, ())
    if restored is not None:
        return restored
    fallback = restore_from(storage, into=into, below=step)
    why = "; ".join(result.problems) or "it does not verify"
    if fallback is None:
        message = (f"whalezen checkpoint: the committed checkpoint {result.uri} fails verification ({why}) "
                   f"and no checkpoint of a lower step verifies: starting from scratch")
    else:
        fallback.skipped = (result, *fallback.skipped)
        message = (f"whalezen checkpoint: the committed checkpoint {result.uri} fails verification ({why}); "
                   f"restoring {fallback.uri} (step {fallback.step}) instead")
    (warn or _warn_stderr)(message)
    return fallback


def _restore_dir(
    storage: Storage, dir_name: str, step: int, into: Path | None, skipped: tuple[VerifyResult, ...],
) -> tuple[Restored | None, VerifyResult]:
    """Verify one checkpoint directory and hand it out as Restored if it is whole."""
    local = storage.local_path(dir_name)
    if local is not None:
        result = verify_in(storage, dir_name)
        if result.ok and result.manifest is not None:
            return Restored(step, result.manifest, result.uri, local, skipped), result
        return None, result
    # Download while verifying: S3 is read once, and what the job loads is exactly what was checked.
    if into is not None:
        Path(into).mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix=f"whalezen-restore-{step}-", dir=into))
    result = verify_in(storage, dir_name, download_to=target)
    if result.ok and result.manifest is not None:
        return Restored(step, result.manifest, result.uri, target, skipped, _owns_directory=True), result
    shutil.rmtree(target, ignore_errors=True)
    return None, result


def _warn_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prune(
    uri: str | Storage, keep: int = 2, *, protect: tuple[int, ...] = (), s3_client: Any = None,
) -> PruneResult:
    """Delete every checkpoint older than the newest `keep` that verify.

    Checked newest first, so only the kept ones are read in full. Never deleted: the kept ones
    (so never the newest verified), anything newer than the oldest kept (a failed verify may be a
    read error, and a newer directory may be mid-write), any directory without a manifest (it
    may be a checkpoint being written right now), and the steps in `protect`.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError("keep must be at least 1: prune never deletes the newest verified checkpoint")
    storage = _storage(uri, s3_client)
    infos = list(reversed(list_checkpoints(storage)))
    kept: list[int] = []
    oldest_kept_index = None
    for index, info in enumerate(infos):
        if not info.has_manifest:
            continue
        if verify_in(storage, _dir_of(info)).ok:
            kept.append(info.step)
            if len(kept) == keep:
                oldest_kept_index = index
                break
    deleted: list[int] = []
    if oldest_kept_index is not None:
        for info in infos[oldest_kept_index + 1:]:
            if info.has_manifest and info.step not in protect:
                storage.delete_dir(_dir_of(info))
                deleted.append(info.step)
    return PruneResult(kept=tuple(kept), deleted=tuple(sorted(deleted)))


def _measure(storage: Storage, rel: str, download_to: Path | None, name: str) -> Measured:
    hasher = Hasher()
    try:
        if download_to is None:
            for chunk in storage.iter_chunks(rel):
                hasher.update(chunk)
        else:
            _download(storage, rel, download_to, name, hasher)
    except FileNotFoundError:
        return Measured(error="missing")
    except OSError as err:
        return Measured(error=f"unreadable: {err.strerror or err}")
    return Measured(size=hasher.size, sha256=hasher.hexdigest)


def _download(storage: Storage, rel: str, target: Path, name: str, hasher: Hasher) -> None:
    check_name(name)  # already checked in the manifest; here because this is where a file is written
    dest = target / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A caller's `into` may already hold links; the file's folder must still resolve inside it.
    target_real, parent_real = target.resolve(), dest.parent.resolve()
    if parent_real != target_real and target_real not in parent_real.parents:
        raise OSError(f"{name!r}: its folder leads outside {target}")
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".wz-tmp-")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in storage.iter_chunks(rel):
                out.write(chunk)
                hasher.update(chunk)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def committed_step(committed_uri: str) -> int | None:
    """The step of a committed checkpoint URI, or None if it names no step directory."""
    try:
        return parse_step_dir(_split_checkpoint_uri(committed_uri)[1])
    except ValueError:
        return None


def _split_checkpoint_uri(uri: str) -> tuple[str, str]:
    """`s3://b/p/step-000000000007` -> (`s3://b/p`, `step-000000000007`); the same for paths."""
    trimmed = uri.strip().rstrip("/")
    parent, sep, name = trimmed.rpartition("/")
    if not sep or not name or parent in ("s3:", "s3:/"):
        raise ValueError(f"{uri!r} is not the URI of a checkpoint directory")
    if parent.endswith("://"):  # "file:///step-1": the parent is the filesystem root
        parent += "/"
    return parent or "/", name


def _dir_of(info: CheckpointInfo) -> str:
    return info.uri.rstrip("/").rsplit("/", 1)[-1]


def _storage(uri: str | Storage, s3_client: Any) -> Storage:
    return open_storage(uri, s3_client=s3_client) if isinstance(uri, str) else uri


__all__ = ["CheckpointInfo", "PruneResult", "Restored", "VerifyResult", "committed_step", "list_checkpoints",
           "prune", "restore_committed", "restore_from", "verify", "verify_in"]
