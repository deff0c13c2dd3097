"""What the agent keeps on disk so a restart neither re-registers nor forgets.

- identity.json (mode 0600): node id and node token from registration.
- state.json: a random agent key (sent at registration so the broker can recognise a retried
  registration), the highest epoch seen (stale-epoch refusal must survive restarts), the status
  reports not yet delivered (outbox), and the assignments this agent has run (with the last
  checkpoint each one reported).
Files are replaced atomically (write, fsync, rename) so a crash never leaves half a file.
The directory is the agent's alone (mode 0700, checked at every start): jobs run as another user
and their work dirs live elsewhere (agent/isolation.py).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_OUTBOX = 1000
MAX_FINISHED_KEPT = 500


@dataclass(frozen=True)
class Identity:
    server_url: str
    node_id: str
    node_token: str
    name: str


@dataclass
class JobRecord:
    assignment_id: str
    job_id: str
    epoch: int
    state: str  # running | exited | failed | stopped | refused
    pid: int | None = None
    pid_start_ticks: int | None = None  # /proc/<pid>/stat start time: tells our process from a reused pid
    gpu_indices: list[int] = field(default_factory=list)
    checkpoint_requests: list[str] = field(default_factory=list)
    # manifest_sha256 of the last checkpoint notice reported to the broker, so that a restarted
    # agent does not report the same checkpoint again (agent/notices.py).
    last_checkpoint_sha256: str | None = None


@dataclass
class AgentState:
    agent_key: str
    node_id: str | None = None  # the node the epoch and the job records below belong to
    max_epoch: int = 0
    outbox: list[dict[str, Any]] = field(default_factory=list)
    jobs: dict[str, JobRecord] = field(default_factory=dict)

    def queue_report(self, report: dict[str, Any]) -> None:
        self.outbox.append(report)
        if len(self.outbox) > MAX_OUTBOX:
            dropped = self.outbox.pop(0)
            log.warning("outbox full: dropped the oldest status report (%s)", dropped.get("assignment_id"))

    def prune_finished(self) -> None:
        finished = [aid for aid, rec in self.jobs.items() if rec.state != "running"]
        for aid in finished[: max(0, len(finished) - MAX_FINISHED_KEPT)]:
            del self.jobs[aid]


class StateDirError(ValueError):
    pass


class StateStore:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        owner = self.directory.stat().st_uid
        if owner != os.geteuid():
            raise StateDirError(f"state dir {self.directory} belongs to uid {owner}, not to this agent "
                                f"(uid {os.geteuid()}): another user could read or replace the node token")
        # mkdir's mode only applies to a folder it creates, and older agents kept job dirs (which
        # jobs could write) in here: close it whatever it was.
        os.chmod(self.directory, 0o700)
        self.identity_path = self.directory / "identity.json"
        self.state_path = self.directory / "state.json"

    def load_identity(self) -> Identity | None:
        data = _read_json(self.identity_path)
        if not data:
            return None
        try:
            return Identity(**data)
        except TypeError:
            log.warning("ignoring unreadable %s", self.identity_path)
            return None

    def save_identity(self, identity: Identity) -> None:
        _write_json(self.identity_path, asdict(identity), mode=0o600)

    def clear_identity(self) -> None:
        self.identity_path.unlink(missing_ok=True)

    def load_state(self) -> AgentState:
        data = _read_json(self.state_path) or {}
        state = AgentState(agent_key=data.get("agent_key") or secrets.token_hex(16))
        state.node_id = data.get("node_id")
        state.max_epoch = int(data.get("max_epoch") or 0)
        state.outbox = list(data.get("outbox") or [])
        for aid, rec in (data.get("jobs") or {}).items():
            try:
                state.jobs[aid] = JobRecord(**rec)
            except TypeError:
                log.warning("ignoring unreadable job record %s", aid)
        if not data:
            self.save_state(state)  # keep the agent key from the very first start
        return state

    def save_state(self, state: AgentState) -> None:
        state.prune_finished()
        data = {
            "agent_key": state.agent_key,
            "node_id": state.node_id,
            "max_epoch": state.max_epoch,
            "outbox": state.outbox,
            "jobs": {aid: asdict(rec) for aid, rec in state.jobs.items()},
        }
        _write_json(self.state_path, data, mode=0o600)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("cannot read %s (%s); starting without it", path, err)
        return None


def _write_json(path: Path, data: Any, *, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def default_state_dir(name: str) -> Path:
    """$WHALEZEN_AGENT_STATE_DIR, else /var/lib/whalezen-agent for root, else a per-user folder."""
    if os.environ.get("WHALEZEN_AGENT_STATE_DIR"):
        return Path(os.environ["WHALEZEN_AGENT_STATE_DIR"])
    if os.geteuid() == 0:
        return Path("/var/lib/whalezen-agent")
    return Path.home() / ".local" / "state" / "whalezen-agent" / name
