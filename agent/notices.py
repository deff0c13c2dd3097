"""Checkpoint notices: what a job's checkpoint helper says it wrote, read safely by the agent.

After every save the helper (agent/checkpoint/checkpointer.py) replaces
`whalezen-checkpoint-written.json` in the job's work dir. That folder is the job's, and the job is
untrusted, while the agent may run as root: the notice is opened without following a link, must
be a regular file with one name (a hard link could point at a file only the agent may read), is
read up to 8 KiB, and every field is checked before anything reaches the broker. A bad notice is
ignored, never fatal, and logged once per assignment (a job rewriting it in a loop must not fill
the agent's log).

Watching is one lstat() per running job per loop step; the file is read only when its
(mtime_ns, size, inode) changed, which every save does (the helper renames a fresh file into place).
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The helper's name for it (agent.checkpoint.NOTICE_FILE_NAME; a test holds them equal). Not
# imported from there: the agent's loop needs none of the helper's storage code.
NOTICE_FILE = "whalezen-checkpoint-written.json"
MAX_NOTICE_BYTES = 8 * 1024
MAX_STEP = 2**62
MAX_URI_CHARS = 1024
MAX_REQUEST_ID_CHARS = 128
_SHA256 = re.compile(r"[0-9a-f]{64}")


class NoticeInvalid(ValueError):
    """The notice is there but is not one the agent may pass on (the message says why)."""


@dataclass(frozen=True)
class CheckpointNotice:
    step: int
    uri: str
    manifest_sha256: str
    request_id: str | None

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "uri": self.uri, "manifest_sha256": self.manifest_sha256,
                "request_id": self.request_id}


def read_notice(path: Path) -> CheckpointNotice:
    """Read and check one notice. FileNotFoundError when there is none, NoticeInvalid when it is bad."""
    try:
        # O_NONBLOCK: a FIFO planted under the name must not block the agent's loop at open().
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == 40:  # ELOOP: the name is a symbolic link
            raise NoticeInvalid("it is a symbolic link") from None
        raise NoticeInvalid(f"cannot open it: {err.strerror or err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NoticeInvalid("it is not a regular file")
        if st.st_nlink != 1:
            raise NoticeInvalid("it has more than one name (a hard link)")
        if st.st_size > MAX_NOTICE_BYTES:
            raise NoticeInvalid(f"it is {st.st_size} bytes, more than {MAX_NOTICE_BYTES}")
        raw = os.read(fd, MAX_NOTICE_BYTES + 1)  # +1: it may have grown since fstat
    finally:
        os.close(fd)
    if len(raw) > MAX_NOTICE_BYTES:
        raise NoticeInvalid(f"it is more than {MAX_NOTICE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except ValueError:
        raise NoticeInvalid("it is not JSON") from None
    return parse_notice(data)


def parse_notice(data: Any) -> CheckpointNotice:
    if not isinstance(data, dict):
        raise NoticeInvalid("it is not a JSON object")
    step = data.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise NoticeInvalid("step must be a whole number from 0 to 2**62")
    uri = data.get("uri")
    if not isinstance(uri, str) or not uri or len(uri) > MAX_URI_CHARS:
        raise NoticeInvalid(f"uri must be a string of 1 to {MAX_URI_CHARS} characters")
    sha = data.get("manifest_sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise NoticeInvalid("manifest_sha256 must be 64 lowercase hex digits")
    request_id = data.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or len(request_id) > MAX_REQUEST_ID_CHARS):
        raise NoticeInvalid(f"request_id must be null or a string of at most {MAX_REQUEST_ID_CHARS} characters")
    return CheckpointNotice(step=step, uri=uri, manifest_sha256=sha, request_id=request_id)


class NoticeWatcher:
    """Notices that changed since the last look, per assignment.

    Deciding whether a notice is new for the broker (its manifest_sha256 against the last one
    reported, which is kept on disk) is the caller's: this only keeps the loop from re-reading an
    unchanged file, and the log from repeating itself.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int, int]] = {}
        self._warned: set[str] = set()

    def check(self, assignment_id: str, workdir: Path) -> CheckpointNotice | None:
        path = workdir / NOTICE_FILE
        try:
            st = os.lstat(path)
        except OSError:  # no notice yet (or the folder is gone)
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if self._seen.get(assignment_id) == key:
            return None
        self._seen[assignment_id] = key
        try:
            return read_notice(path)
        except FileNotFoundError:
            return None
        except (NoticeInvalid, OSError) as err:  # OSError: a read error (EIO) is no reason to stop the loop
            if assignment_id not in self._warned:
                self._warned.add(assignment_id)
                log.warning("assignment %s: ignoring its checkpoint notice %s: %s "
                            "(further bad notices of this assignment are not logged)", assignment_id, path, err)
            return None

    def forget(self, assignment_id: str) -> None:
        self._seen.pop(assignment_id, None)
        self._warned.discard(assignment_id)
