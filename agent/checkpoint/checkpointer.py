"""The job's side: when to checkpoint, how to write one, and telling the agent it is written.

A request reaches a running job two ways (agent/jobs.py): the agent writes
`whalezen-checkpoint-request.json` in the job's work dir, then sends SIGUSR1 if the job's main
process handles it. The file is the truth and the signal only a wake-up: a request counts as
pending while the file names a request_id this job has not answered yet, so a lost or early
signal never loses a request. Answering one means a checkpoint whose manifest carries that
request_id, followed by the notice `whalezen-checkpoint-written.json` in the work dir.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.checkpoint.checkpoints import (
    CheckpointInfo,
    PruneResult,
    Restored,
    list_checkpoints,
    prune,
    restore_committed,
    restore_from,
)
from agent.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    build_manifest,
    check_name,
    sha256_hex,
    step_dir_name,
)
from agent.checkpoint.storage import Storage, open_storage, write_atomic

# The agent's name for the request file (agent/jobs.py CHECKPOINT_REQUEST_FILE; a test holds them
# equal). Not imported: agent.jobs pulls in the agent's process machinery, which a job needs none of.
REQUEST_FILE_NAME = "whalezen-checkpoint-request.json"
NOTICE_FILE_NAME = "whalezen-checkpoint-written.json"
# Where no agent shares the job's file system (a Kubernetes Pod: agent/kube/), the notice is also printed
# as one line of the job's output, which the bridge reads through the Pod's log.
NOTICE_LOG_ENV = "WHALEZEN_CHECKPOINT_NOTICE_LOG"
NOTICE_LOG_PREFIX = "WHALEZEN_CHECKPOINT_WRITTEN "
DEFAULT_DATA_NAME = "data"

Sources = Mapping[str, Path | str] | Iterable[Path | str] | Path | str


@dataclass(frozen=True)
class Request:
    request_id: str | None  # None: SIGUSR1 arrived but the file names no new request (a manual kill -USR1)
    via: str  # "signal" when SIGUSR1 was seen, else "file"
    requested_at: float | None = None
    checkpoint_uri: str | None = None


@dataclass(frozen=True)
class SaveResult:
    step: int
    uri: str  # the checkpoint directory
    manifest_sha256: str
    request_id: str | None  # the request this checkpoint answers, if one was pending
    files: tuple[FileEntry, ...]
    notice_path: Path | None  # None outside WhaleZen (no WHALEZEN_WORK_DIR)


class Checkpointer:
    """One per training process. `due(step)` once per step, `save()` when it says so.

    Nothing here is global until install_signal_handler() (or handle_signal=True) replaces the
    process's SIGUSR1 handler; without it requests are still seen by reading the request file,
    one stat() per due() call.
    """

    def __init__(
        self,
        uri: str | None = None,
        *,
        interval_steps: int | None = None,
        interval_seconds: float | None = None,
        handle_signal: bool = False,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        s3_client: Any = None,
    ) -> None:
        env = os.environ if env is None else env
        self.uri = uri or env.get("WHALEZEN_CHECKPOINT_URI") or ""
        if not self.uri:
            raise ValueError("no checkpoint URI: the job spec has no checkpoint.uri "
                             "(pass uri= to try it outside WhaleZen)")
        self.storage: Storage = open_storage(self.uri, s3_client=s3_client)
        self._s3_client = s3_client
        # What the broker committed for this job (agent/jobs.py sets it from the assignment):
        # None when the agent said nothing (an older broker), "" for "start from scratch", else
        # the URI of one checkpoint directory.
        self.restore_from_uri: str | None = env.get("WHALEZEN_RESTORE_FROM")
        self.job_id = env.get("WHALEZEN_JOB_ID") or None
        epoch = env.get("WHALEZEN_EPOCH")
        self.epoch = int(epoch) if epoch and epoch.lstrip("-").isdigit() else None
        work_dir = env.get("WHALEZEN_WORK_DIR")
        self.work_dir = Path(work_dir) if work_dir else None
        self.notice_to_log = env.get(NOTICE_LOG_ENV) == "1"
        request_file = env.get("WHALEZEN_CHECKPOINT_REQUEST_FILE")
        self.request_file = Path(request_file) if request_file else (
            self.work_dir / REQUEST_FILE_NAME if self.work_dir else None)
        self.interval_steps = interval_steps
        self.interval_seconds = interval_seconds
        self._clock = clock
        self._signalled = False
        self._previous_handler: Any = None
        self._request_cache: tuple[tuple[int, int, int], dict[str, Any] | None] | None = None
        self._answered: set[str] = self._answered_from_notice()
        self._last_step: int | None = None
        self._last_time = clock()
        if handle_signal:
            self.install_signal_handler()

    # -- requests ---------------------------------------------------------------------------

    def install_signal_handler(self) -> None:
        """Catch SIGUSR1 (main thread only, as for any signal handler). A handler that was there
        before still runs, so a framework's own SIGUSR1 use keeps working."""
        previous = signal.signal(signal.SIGUSR1, self._on_signal)
        if previous is not self._on_signal:
            self._previous_handler = previous

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: a handler runs between two bytecodes of the training step, and writing a
        # checkpoint from there would save a half-updated model.
        self._signalled = True
        if callable(self._previous_handler):
            self._previous_handler(signum, frame)

    def requested(self) -> Request | None:
        """The pending checkpoint request, or None."""
        pending = self._request_from_file()
        if pending is not None:
            return Request(request_id=str(pending["request_id"]), via="signal" if self._signalled else "file",
                           requested_at=pending.get("requested_at"),
                           checkpoint_uri=pending.get("checkpoint_uri"))
        if self._signalled:
            return Request(request_id=None, via="signal")
        return None

    def _request_from_file(self) -> dict[str, Any] | None:
        if self.request_file is None:
            return None
        try:
            st = os.stat(self.request_file)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._request_cache is None or self._request_cache[0] != key:
            # The agent replaces the file by rename, so a new request is a new inode: re-read only then.
            try:
                data = json.loads(Path(self.request_file).read_text())
            except (OSError, ValueError):
                data = None
            if not isinstance(data, dict) or data.get("request_id") in (None, ""):
                data = None
            self._request_cache = (key, data)
        data = self._request_cache[1]
        if data is None or str(data["request_id"]) in self._answered:
            return None
        return data

    def due(self, step: int) -> bool:
        """True when a request is pending or an interval (steps or seconds) has run out."""
        if self._last_step is None:
            self._last_step = step  # the first step seen is the baseline for interval_steps
        if self.requested() is not None:
            return True
        if self.interval_steps is not None and step - self._last_step >= self.interval_steps:
            return True
        return self.interval_seconds is not None and self._clock() - self._last_time >= self.interval_seconds

    # -- writing ----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        data: bytes | Mapping[str, bytes] | None = None,
        *,
        files: Sources | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> SaveResult:
        """Write one checkpoint: data files first, `manifest.json` last, then the notice.

        `data` is one blob (read back as Restored.data) or a mapping name -> bytes; `files` maps
        names to local files to copy (or lists paths, each stored under its base name). Every
        name is checked before anything is written.
        """
        sources = _sources(data, files)
        dir_name = step_dir_name(step)
        pending = self.requested()
        # Cleared before writing: a SIGUSR1 that lands while we write is a new request, not this one.
        self._signalled = False
        request_id = pending.request_id if pending is not None else None

        # Re-saving a step: take its old manifest away first, so no reader ever pairs the old
        # manifest with files that are being replaced under it.
        self.storage.remove(f"{dir_name}/{MANIFEST_NAME}")
        entries = []
        for name, source in sources:
            size, digest = self.storage.put(f"{dir_name}/{name}", source)
            entries.append(FileEntry(name=name, size=size, sha256=digest))
        self.storage.commit_dir(dir_name)
        manifest = build_manifest(step=step, files=entries, job_id=self.job_id, epoch=self.epoch,
                                  created_at=time.time(), request_id=request_id, extra=extra)
        raw = manifest.to_bytes()
        self.storage.put(f"{dir_name}/{MANIFEST_NAME}", raw)  # the commit point
        self.storage.commit_dir(dir_name)

        if request_id is not None:
            self._answered.add(request_id)
        result = SaveResult(step=step, uri=self.storage.uri_of(dir_name), manifest_sha256=sha256_hex(raw),
                            request_id=request_id, files=manifest.files, notice_path=None)
        notice = self._write_notice(result)
        self._last_step, self._last_time = step, self._clock()
        return replace(result, notice_path=notice)

    def _write_notice(self, result: SaveResult) -> Path | None:
        """Tell the agent (its notice file in the work dir). A work dir the job cannot write loses the
        notice, not the training run: the checkpoint is on storage, the broker just never hears of it."""
        try:
            return self._write_notice_file(result)
        except OSError as err:
            print(f"whalezen checkpoint: step {result.step} saved, but the agent cannot be told "
                  f"({err}); the broker will not restore it", file=sys.stderr, flush=True)
            return None

    def _write_notice_file(self, result: SaveResult) -> Path | None:
        if self.work_dir is None or not self.work_dir.is_dir():
            return None
        path = self.work_dir / NOTICE_FILE_NAME
        notice = {
            "request_id": result.request_id,
            "step": result.step,
            "uri": result.uri,
            "manifest_sha256": result.manifest_sha256,
            "written_at": time.time(),
            "job_id": self.job_id,
            "epoch": self.epoch,
            # A later periodic checkpoint answers nothing; this keeps a restarted process in the
            # same work dir from answering the same request twice.
            "last_answered_request_id": result.request_id or self._last_answered_in_notice(),
        }
        line = json.dumps(notice, sort_keys=True)
        write_atomic(path, (line + "\n").encode())
        if self.notice_to_log:
            print(NOTICE_LOG_PREFIX + line, flush=True)
        return path

    def _read_notice(self) -> dict[str, Any]:
        if self.work_dir is None:
            return {}
        try:
            data = json.loads((self.work_dir / NOTICE_FILE_NAME).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _last_answered_in_notice(self) -> str | None:
        value = self._read_notice().get("last_answered_request_id")
        return value if isinstance(value, str) else None

    def _answered_from_notice(self) -> set[str]:
        notice = self._read_notice()
        ids = (notice.get("request_id"), notice.get("last_answered_request_id"))
        return {value for value in ids if isinstance(value, str)}

    # -- reading ----------------------------------------------------------------------------

    def restore(self, *, into: Path | None = None) -> Restored | None:
        """What to resume from; S3 downloads go under `into`, default the work dir, so they are
        cleaned up with the job.

        With WHALEZEN_RESTORE_FROM set (the broker says): "" is None (nothing committed, start
        from scratch, whatever the storage holds); a URI is exactly that checkpoint once it
        verifies, else the newest verified one of a lower step (a warning on stderr names both).
        Without it: the newest checkpoint that verifies (see restore_from).
        """
        target = into if into is not None else self.work_dir
        if self.restore_from_uri is None:
            restored = restore_from(self.storage, into=target)
        elif not self.restore_from_uri.strip():
            return None
        else:
            restored = restore_committed(self.restore_from_uri, into=target, s3_client=self._s3_client)
        if restored is not None:
            self._last_step, self._last_time = restored.step, self._clock()
        return restored

    def list(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.storage)

    @property
    def broker_prunes(self) -> bool:
        """Whether a WhaleZen broker manages this job's checkpoints (its agent said what to restore,
        "" included): it deletes old ones itself, once two newer ones are committed."""
        return self.restore_from_uri is not None

    def prune(self, keep: int = 2) -> PruneResult:
        """Outside WhaleZen, prune(): keep the newest `keep` that verify. Under a broker that
        manages the checkpoints, nothing: the job cannot know which of its checkpoints the broker
        has committed yet (it verifies each after the write, and may lag behind), and deleting one
        it did commit would leave a restart nothing to restore."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError("keep must be at least 1: prune never deletes the newest verified checkpoint")
        if self.broker_prunes:
            return PruneResult(kept=(), deleted=())
        return prune(self.storage, keep=keep)


def _sources(
    data: bytes | Mapping[str, bytes] | None, files: Sources | None,
) -> list[tuple[str, bytes | Path]]:
    sources: list[tuple[str, bytes | Path]] = []
    if isinstance(data, (bytes, bytearray, memoryview)):
        sources.append((DEFAULT_DATA_NAME, bytes(data)))
    elif isinstance(data, Mapping):
        for name, blob in data.items():
            if not isinstance(blob, (bytes, bytearray, memoryview)):
                raise TypeError(f"data[{name!r}] must be bytes, not {type(blob).__name__}")
            sources.append((name, bytes(blob)))
    elif data is not None:
        raise TypeError("data must be bytes or a mapping of names to bytes")
    if isinstance(files, Mapping):
        sources.extend((name, Path(path)) for name, path in files.items())
    elif files is not None:
        if isinstance(files, (str, Path)):
            files = [files]
        sources.extend((Path(path).name, Path(path)) for path in files)
    if not sources:
        raise ValueError("save() needs data= or files=")
    for name, _ in sources:
        check_name(name)
    names = [name for name, _ in sources]
    if len(set(names)) != len(names):
        raise ValueError("two checkpoint files have the same name")
    for name, source in sources:
        if isinstance(source, Path) and not source.is_file():
            raise FileNotFoundError(f"checkpoint file {name!r}: {source} is not a file")
    return sources
