"""The local provider: node agents as local processes with fake GPUs, so the whole system runs
on one machine; optionally it behaves like a cloud (launch latency, capacity errors, spot
interruptions) for demos and tests.

State lives in `state_dir/instances/<id>.json` (pid, process start time, request key), so
`list_owned` and `terminate` keep working after the broker restarts.

Each instance is providers/local/instance.py with the agent as its child: it serves the
instance's own metadata endpoint (AWS IMDSv2 answers, on 127.0.0.1 under an unguessable path),
and the agent is started with `--spot-notice local --metadata-url <that endpoint>`.
`interrupt(ref, after_seconds=120)` posts a spot notice there (a file in this provider's state
dir, `instances/<id>.spot`); when its time passes the instance ends itself, as a cloud would, and
the provider also terminates it the next time it looks (describe, list_owned, tick).
"""
from __future__ import annotations

import fcntl
import inspect
import json
import math
import os
import random
import secrets
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from providers.base import (
    FAST_FABRICS,
    ErrorKind,
    InstanceInfo,
    InstanceRef,
    InstanceState,
    Offer,
    Provider,
    ProviderError,
    ProvisionRequest,
    tags_tuple,
)
from providers.local import processes


@dataclass(frozen=True)
class LocalShape:
    """A node shape the local provider can start. `fake_gpus` is the agent's --fake-gpus spec."""

    instance_type: str
    fake_gpus: str
    gpu_model: str
    gpu_count: int
    gpu_memory_mib: int
    vcpus: float
    memory_gib: float
    price_per_hour: float = 0.0
    spot_price_per_hour: float | None = None
    fabric: tuple[str, ...] = ()


DEFAULT_SHAPES: tuple[LocalShape, ...] = (
    LocalShape("local-8xA100-80GB-SXM", "8xA100-80GB-SXM", "A100-80GB", 8, 81920, 96, 1024, fabric=("nvlink",)),
    LocalShape("local-8xH100-80GB-SXM", "8xH100-80GB-SXM", "H100", 8, 81559, 192, 2048, fabric=("nvlink",)),
    LocalShape("local-4xT4", "4xT4", "T4", 4, 15360, 48, 192),
    LocalShape("local-1xL4", "1xL4", "L4", 1, 23034, 12, 48),
)


@dataclass(frozen=True)
class CloudSimulation:
    """How much the local provider should behave like a real cloud. All randomness comes from
    one RNG seeded with `seed`, so a demo or test run is repeatable."""

    launch_latency_s: float = 0.0  # describe() says PENDING this long after provision()
    capacity_error_probability: float = 0.0
    forced_capacity_errors: frozenset[tuple[str, str]] = frozenset()  # (zone, instance_type); "*" = any
    spot_interruption_probability: float = 0.0  # per spot instance per tick()
    # How long before an interruption tick() posts its spot notice (AWS gives 120 s); 0: the
    # instance is terminated at once, without a notice.
    spot_notice_seconds: float = 0.0
    seed: int = 0


CommandFactory = Callable[[ProvisionRequest, str, LocalShape], Sequence[str]]

# What a local agent inherits from the broker's environment when no `env` is given: what it needs
# to run Python and find the agent, its own WHALEZEN_AGENT_* settings, nothing else. The broker's
# environment holds its secrets (DJANGO_SECRET_KEY, DATABASE_URL, cloud credentials), and an
# agent hands its environment on to the jobs it runs.
# The container runtimes' own settings go too (paths and a socket address, no secrets): an agent
# runs image jobs through podman or docker with the host's configuration.
AGENT_ENV_NAMES = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH",
                             "VIRTUAL_ENV", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
                             "CONTAINERS_CONF", "CONTAINERS_REGISTRIES_CONF", "CONTAINERS_STORAGE_CONF", "DOCKER_HOST"})
AGENT_ENV_PREFIXES = ("LC_", "WHALEZEN_AGENT_")


def agent_environment(parent: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in parent.items() if k in AGENT_ENV_NAMES or k.startswith(AGENT_ENV_PREFIXES)}


# The agent's compatibility variable for the join token. The local provider no longer uses it: a
# process's initial environment stays readable in /proc/<pid>/environ for its whole life.
JOIN_TOKEN_ENV = "WHALEZEN_JOIN_TOKEN"


INSTANCE_SCRIPT = Path(__file__).resolve().with_name("instance.py")
SPOT_NOTICE_SECONDS = 120.0  # what AWS gives


def agent_command(python: str, state_root: str | os.PathLike[str] | None = None) -> CommandFactory:
    """`<python> -m agent --server URL --fake-gpus SPEC --name NAME --join-token - [--state-dir DIR]
    [--spot-notice local --metadata-url URL]`; the join token arrives on the agent's stdin
    (`--join-token -`): neither its command line nor its environment holds it. Each agent gets its
    own state dir: agents started as root would otherwise all share /var/lib/whalezen-agent and its
    node token. The provider passes each instance's metadata endpoint as `metadata_url`."""

    def build(request: ProvisionRequest, name: str, shape: LocalShape, metadata_url: str | None = None) -> list[str]:
        argv = [python, "-m", "agent", "--server", request.agent_server_url, "--fake-gpus", shape.fake_gpus,
                "--name", name, "--join-token", "-"]
        if state_root is not None:
            argv += ["--state-dir", str(Path(state_root) / name)]
        if metadata_url is not None:
            argv += ["--spot-notice", "local", "--metadata-url", metadata_url]
        # The node says what its offer said: a shape sold with a fast fabric is a node on one (the
        # `fabric` label the scheduler reads for multi-node jobs).
        fast = [f for f in shape.fabric if f in FAST_FABRICS]
        if fast:
            argv += ["--label", f"fabric={fast[0]}"]
        return argv

    return build


def _takes_metadata_url(factory: CommandFactory) -> bool:
    """Command factories written before metadata endpoints take three arguments; they still work."""
    try:
        return "metadata_url" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _iso_z(moment: float) -> str:
    return datetime.fromtimestamp(moment, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Record:
    instance_id: str
    broker_id: str
    request_key: str
    allocation_id: str
    instance_type: str
    region: str
    zone: str
    spot: bool
    name: str
    pid: int
    pid_start: int | None
    created_at: float
    ready_at: float
    state: str = "running"  # running | terminated
    state_reason: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    metadata_url: str = ""  # the instance's metadata endpoint (empty: a record from before they existed)
    spot_deadline: float | None = None  # a spot notice was posted: the instance ends at this Unix time


class LocalProvider(Provider):
    kind = "local"

    def __init__(
        self,
        *,
        broker_id: str,
        state_dir: str | os.PathLike[str],
        shapes: Sequence[LocalShape] = DEFAULT_SHAPES,
        region: str = "local",
        zones: Sequence[str] = ("local-a",),
        python: str = sys.executable,
        command_factory: CommandFactory | None = None,
        simulation: CloudSimulation = CloudSimulation(),
        env: Mapping[str, str] | None = None,
        stop_timeout_s: float = 5.0,
        nice: int = 10,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(broker_id=broker_id)
        self.state_dir = Path(state_dir)
        self.shapes = {s.instance_type: s for s in shapes}
        self.region = region
        self.zones = list(zones)
        self.python = python
        self.command_factory = command_factory or agent_command(python, self.state_dir / "agents")
        self.simulation = simulation
        self.env = env
        self.stop_timeout_s = stop_timeout_s
        # Simulated instances run on the broker's own machine, which a rented one does not: at a lower
        # CPU priority (niceness, inherited by the agent and its jobs) they leave the service its cores.
        self.nice = nice
        self._clock = clock
        self._rng = random.Random(simulation.seed)
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        # The broker's own records and the agents' logs: closed to the jobs that run on this machine
        # (as another user). `agents/` stays traversable: job work dirs live beside the agents' state.
        for private in ("instances", "logs"):
            (self.state_dir / private).mkdir(parents=True, exist_ok=True)
            os.chmod(self.state_dir / private, 0o700)

    # -- state files ---------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer at a time, across processes (two broker workers may share a state dir)."""
        with (self.state_dir / ".lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _path(self, instance_id: str) -> Path:
        return self.state_dir / "instances" / f"{instance_id}.json"

    def _notice_path(self, instance_id: str) -> Path:
        # Not *.json: _records() globs those. Read by the instance's own process (instance.py).
        return self.state_dir / "instances" / f"{instance_id}.spot"

    def _save(self, record: _Record) -> None:
        path = self._path(record.instance_id)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # unique per writer
        tmp.write_text(json.dumps(record.__dict__, sort_keys=True))
        os.replace(tmp, path)  # atomic: a crash never leaves half a record

    def _load(self, instance_id: str) -> _Record | None:
        try:
            return _Record(**json.loads(self._path(instance_id).read_text()))
        except FileNotFoundError:
            return None

    def _records(self) -> list[_Record]:
        records = []
        for path in sorted((self.state_dir / "instances").glob("*.json")):
            try:
                records.append(_Record(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue  # a foreign or damaged file is not ours to act on
        return [r for r in records if r.broker_id == self.broker_id]

    def _info(self, record: _Record) -> InstanceInfo:
        processes.reap(self._children)
        if record.state == "running" and not processes.is_alive(record.pid, record.pid_start):
            # The agent process is gone (crashed, killed): for a simulated cloud that is a lost
            # instance, and we know for sure it is not running any more.
            # An instance that ended itself at its spot notice's time was interrupted, not lost.
            interrupted = record.spot_deadline is not None and self._clock() >= record.spot_deadline - 1
            record.state = "terminated"
            record.state_reason = record.state_reason or ("spot-interruption" if interrupted else "process-exited")
            self._save(record)
        if record.state == "terminated":
            state = InstanceState.TERMINATED
        elif self._clock() < record.ready_at:
            state = InstanceState.PENDING
        else:
            state = InstanceState.RUNNING
        return InstanceInfo(
            ref=InstanceRef(provider="local", region=record.region, zone=record.zone, instance_id=record.instance_id),
            state=state,
            instance_type=record.instance_type,
            spot=record.spot,
            request_key=record.request_key,
            launched_at=datetime.fromtimestamp(record.created_at, tz=timezone.utc),
            private_ip="127.0.0.1",
            tags=tags_tuple(record.tags),
            state_reason=record.state_reason,
        )

    # -- the contract --------------------------------------------------------------------
    def list_offers(self) -> list[Offer]:
        return [
            Offer(provider="local", region=self.region, zone=zone, instance_type=s.instance_type,
                  gpu_model=s.gpu_model, gpu_count=s.gpu_count, gpu_memory_mib=s.gpu_memory_mib, vcpus=s.vcpus,
                  memory_gib=s.memory_gib, on_demand_per_hour=s.price_per_hour, spot_per_hour=s.spot_price_per_hour,
                  fabric=s.fabric)
            for zone in self.zones
            for s in self.shapes.values()
        ]

    def _simulated_capacity_error(self, zone: str, instance_type: str) -> bool:
        forced = self.simulation.forced_capacity_errors
        if {(zone, instance_type), ("*", instance_type), (zone, "*"), ("*", "*")} & forced:
            return True
        return self._rng.random() < self.simulation.capacity_error_probability

    def provision(self, request: ProvisionRequest) -> InstanceInfo:
        shape = self.shapes.get(request.instance_type)
        if shape is None:
            raise ProviderError(ErrorKind.BAD_REQUEST, f"unknown local shape {request.instance_type}; "
                                f"known: {sorted(self.shapes)}", provider="local")
        zone = request.zone or self.zones[0]
        if zone not in self.zones:
            raise ProviderError(ErrorKind.BAD_REQUEST, f"unknown local zone {zone}", provider="local")
        with self._locked():
            for record in self._records():
                if record.request_key == request.request_key:
                    return self._info(record)  # same key, same instance
            if self._simulated_capacity_error(zone, request.instance_type):
                raise ProviderError(ErrorKind.CAPACITY, f"simulated: no {request.instance_type} capacity in {zone}",
                                    provider="local", code="SimulatedInsufficientCapacity")
            instance_id = f"local-{uuid.uuid4().hex[:12]}"
            name = request.node_name or instance_id
            env = dict(self.env) if self.env is not None else agent_environment(os.environ)
            env.pop(JOIN_TOKEN_ENV, None)
            # The metadata endpoint's socket is bound here, so its URL is in the agent's command
            # line from the start; the instance process serves on it (instance.py).
            listener = socket.create_server(("127.0.0.1", 0))
            # Hex: a URL-safe token may begin with "-", which argparse reads as an option (the
            # instance then failed to start about once in 64 launches).
            secret = secrets.token_hex(24)
            metadata_url = f"http://127.0.0.1:{listener.getsockname()[1]}/{secret}"
            if _takes_metadata_url(self.command_factory):
                command = self.command_factory(request, name, shape, metadata_url=metadata_url)
            else:
                command = self.command_factory(request, name, shape)
            self._notice_path(instance_id).unlink(missing_ok=True)
            try:
                process = processes.spawn(
                    [self.python, str(INSTANCE_SCRIPT), "--listen-fd", str(listener.fileno()), f"--secret={secret}",
                     "--notice-file", str(self._notice_path(instance_id)), "--grace", f"{self.stop_timeout_s:g}",
                     f"--nice={self.nice}", "--", *command],
                    log_path=self.state_dir / "logs" / f"{instance_id}.log",
                    env=env,
                    stdin_data=f"{request.agent_join_token}\n".encode(),
                    pass_fds=(listener.fileno(),),
                )
            finally:
                listener.close()  # the instance has its own copy
            self._children[process.pid] = process
            now = self._clock()
            record = _Record(
                instance_id=instance_id, broker_id=self.broker_id, request_key=request.request_key,
                allocation_id=request.allocation_id, instance_type=request.instance_type, region=self.region,
                zone=zone, spot=request.spot, name=name, pid=process.pid,
                pid_start=processes.process_start_time(process.pid), created_at=now,
                ready_at=now + self.simulation.launch_latency_s,
                tags=self.broker_tags(request, created_at=datetime.fromtimestamp(now, tz=timezone.utc)),
                metadata_url=metadata_url,
            )
            self._save(record)
        return self._info(record)

    def describe(self, ref: InstanceRef) -> InstanceInfo:
        record = self._load(ref.instance_id)
        if record is None or record.broker_id != self.broker_id:
            return InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
        if self._notice_expired(record):
            return self.terminate(ref, reason="spot-interruption")
        return self._info(record)

    def terminate(self, ref: InstanceRef, *, reason: str = "terminated") -> InstanceInfo:
        with self._locked():
            record = self._load(ref.instance_id)
            if record is None or record.broker_id != self.broker_id:
                return InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
            self._notice_path(record.instance_id).unlink(missing_ok=True)
            if record.state != "terminated":
                if not processes.stop(record.pid, record.pid_start, timeout_s=self.stop_timeout_s,
                                      children=self._children):
                    return InstanceInfo(ref=ref, state=InstanceState.TERMINATING)
                record.state, record.state_reason = "terminated", reason
                self._save(record)
            return self._info(record)

    def list_owned(self) -> list[InstanceInfo]:
        return [self.terminate(self._ref(r), reason="spot-interruption") if self._notice_expired(r) else self._info(r)
                for r in self._records()]

    def _ref(self, record: _Record) -> InstanceRef:
        return InstanceRef(provider="local", region=record.region, zone=record.zone, instance_id=record.instance_id)

    # -- cloud simulation ----------------------------------------------------------------
    def _notice_expired(self, record: _Record) -> bool:
        return record.state != "terminated" and record.spot_deadline is not None and \
            self._clock() >= record.spot_deadline

    def interrupt(self, ref: InstanceRef, after_seconds: float = SPOT_NOTICE_SECONDS) -> InstanceInfo:
        """Post a spot interruption notice: the instance's metadata endpoint answers it from now
        on (its agent tells the broker), and the instance is terminated once `after_seconds`
        have passed. `after_seconds <= 0`: terminated at once, without a notice. A second notice
        never moves the time of the first one later."""
        if after_seconds <= 0:
            return self.terminate(ref, reason="spot-interruption")
        with self._locked():
            record = self._load(ref.instance_id)
            if record is None or record.broker_id != self.broker_id:
                return InstanceInfo(ref=ref, state=InstanceState.TERMINATED, state_reason="not-found")
            if record.state == "terminated":
                return self._info(record)
            # Whole seconds, rounded up: the notice's time (ISO, to the second) is the deadline itself.
            deadline = float(math.ceil(self._clock() + after_seconds))
            if record.spot_deadline is not None:
                deadline = min(deadline, record.spot_deadline)
            notice = {"action": "terminate", "time": _iso_z(deadline)}
            path = self._notice_path(record.instance_id)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            tmp.write_text(json.dumps(notice))
            os.replace(tmp, path)  # the instance never reads half a notice
            record.spot_deadline = deadline
            self._save(record)
            return self._info(record)

    def tick(self) -> list[InstanceInfo]:
        """One step of the simulated spot market: each running spot instance without a notice yet
        is interrupted with `spot_interruption_probability` (a notice `spot_notice_seconds` ahead,
        or at once when that is 0). Returns the interrupted instances; instances whose notice ran
        out are terminated too (by list_owned)."""
        interrupted = []
        for info in self.list_owned():
            if info.spot and info.state is not InstanceState.TERMINATED:
                record = self._load(info.ref.instance_id)
                if record is not None and record.spot_deadline is None and \
                        self._rng.random() < self.simulation.spot_interruption_probability:
                    interrupted.append(self.interrupt(info.ref, after_seconds=self.simulation.spot_notice_seconds))
        return interrupted

    def prune(self, *, older_than_s: float) -> int:
        """Forget terminated instances older than `older_than_s` (their state files)."""
        removed = 0
        with self._locked():
            for record in self._records():
                if record.state == "terminated" and self._clock() - record.created_at > older_than_s:
                    self._path(record.instance_id).unlink(missing_ok=True)
                    self._notice_path(record.instance_id).unlink(missing_ok=True)
                    removed += 1
        return removed
