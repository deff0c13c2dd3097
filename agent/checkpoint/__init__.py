"""Checkpoints for WhaleZen jobs: what a training script imports (standard library only).

    from agent import checkpoint

    ckpt = checkpoint.install(interval_seconds=600)   # SIGUSR1 handler + the job's env
    restored = ckpt.restore()                          # what the broker committed, else newest verified
    step = restored.step + 1 if restored else 0
    while step < total:
        train_one_step()
        if ckpt.due(step):                             # a request is pending, or the interval ran out
            ckpt.save(step, {"model.pt": model_bytes}) # files first, manifest.json last, then the notice
        step += 1

`verify(uri)`, `list_checkpoints(uri)` and `prune(uri, keep=2)` work from a plain URI with no job
env (the broker verifies with them). boto3 is needed only for `s3://` URIs and imported only then.
See docs/checkpoints.md.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.checkpoint.checkpointer import (
    DEFAULT_DATA_NAME,
    NOTICE_FILE_NAME,
    REQUEST_FILE_NAME,
    Checkpointer,
    Request,
    SaveResult,
)
from agent.checkpoint.checkpoints import (
    CheckpointInfo,
    PruneResult,
    Restored,
    VerifyResult,
    list_checkpoints as _list_checkpoints,
    prune as _prune,
    restore_committed,
    restore_from,
    verify,
)
from agent.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    UnsafeName,
)

_default: Checkpointer | None = None


def install(**options: Any) -> Checkpointer:
    """The process's Checkpointer, built from the job's env, with the SIGUSR1 handler installed.
    Options are Checkpointer's (uri, interval_steps, interval_seconds, ...); a second call replaces it."""
    global _default
    _default = Checkpointer(handle_signal=True, **options)
    return _default


def default() -> Checkpointer:
    """The Checkpointer the module-level functions use: built from the env on first use, without
    a signal handler (call install() for one)."""
    global _default
    if _default is None:
        _default = Checkpointer()
    return _default


def restore(uri: str | None = None, *, into: Path | None = None) -> Restored | None:
    """What to resume from at `uri` (default: $WHALEZEN_CHECKPOINT_URI), or None: the checkpoint
    the broker committed ($WHALEZEN_RESTORE_FROM) when it said one, else the newest verified one
    (Checkpointer.restore)."""
    return default().restore(into=into) if uri is None else Checkpointer(uri).restore(into=into)


def save(step: int, data: Any = None, *, files: Any = None, extra: Any = None) -> SaveResult:
    return default().save(step, data, files=files, extra=extra)


def requested() -> Request | None:
    return default().requested()


def list_checkpoints(uri: str | None = None) -> list[CheckpointInfo]:
    return default().list() if uri is None else _list_checkpoints(uri)


def prune(uri: str | None = None, keep: int = 2) -> PruneResult:
    return default().prune(keep) if uri is None else _prune(uri, keep=keep)


__all__ = [
    "DEFAULT_DATA_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "NOTICE_FILE_NAME", "REQUEST_FILE_NAME",
    "CheckpointInfo", "Checkpointer", "FileEntry", "Manifest", "ManifestError", "PruneResult", "Request",
    "Restored", "SaveResult", "UnsafeName", "VerifyResult", "default", "install", "list_checkpoints", "prune",
    "requested", "restore", "restore_committed", "restore_from", "save", "verify",
]
