"""Assignments from the broker, and the job processes the agent runs for them.

Each job runs in its own session (process group) so a stop reaches everything it spawned, with
stdin closed and stdout/stderr appended to `<work dir>/<assignment id>/job.log`. Its working
directory is that folder (outside the agent's state dir, owned by the job user, see
agent/isolation.py); a checkpoint request is a JSON file written there plus SIGUSR1 to the job's
main process only (SIGUSR1 kills by default, so its helpers must not get it uninvited).

The session's leader is agent/jobshim.py, which runs the job as the job user and takes the whole
group down when the agent dies (PR_SET_PDEATHSIG), so no job outlives its agent. The job's folder
is the job's to write: the agent never follows a link there (a job could point job.log or the
request file at a file only the agent may read or write).
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.gang import GANG_ENV, Gang
from agent.isolation import JobUser, job_home, make_job_dir, prepare_work_root, resolve_job_user
from agent.jobfiles import JobFile, fetch_failure, parse_files, plan, with_fetch
from agent.procs import catches_signal
from agent.runtimes import (ImageInvalid, Runtime, container_command, container_name, image_reference,
                            remove_container)

log = logging.getLogger(__name__)

CHECKPOINT_REQUEST_FILE = "whalezen-checkpoint-request.json"
JOBSHIM = Path(__file__).resolve().with_name("jobshim.py")  # absolute: jobs start in their own cwd
SHIM_START_TIMEOUT_S = 30.0  # a Python start on a loaded node; only a wedged machine takes longer
ACTIONS = ("start", "stop", "checkpoint")
# Set by the agent; the assignment's env cannot override them.
RESERVED_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "WHALEZEN_JOB_ID",
    "WHALEZEN_ASSIGNMENT_ID",
    "WHALEZEN_EPOCH",
    "WHALEZEN_NODE_ID",
    "WHALEZEN_CHECKPOINT_URI",
    "WHALEZEN_CHECKPOINT_REQUEST_FILE",
    "WHALEZEN_WORK_DIR",
    "WHALEZEN_RESTORE_FROM",
    *GANG_ENV,  # rank, peers, MASTER_ADDR/PORT (agent/gang.py)
)
# Never handed to jobs: the agent's own secrets and GPU selection.
_AGENT_ONLY_ENV_PREFIXES = ("WHALEZEN_",)
_AGENT_ONLY_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


class AssignmentInvalid(ValueError):
    pass


class JobStartError(RuntimeError):
    pass


@dataclass(frozen=True)
class Assignment:
    id: str
    job_id: str
    epoch: int
    action: str
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...] | None
    gpu_milli: int  # share of each GPU, 1000 = whole; several fractional jobs may share a GPU
    command: tuple[str, ...] | str
    env: Mapping[str, str]
    checkpoint_uri: str | None
    checkpoint_request_id: str | None
    # The checkpoint the broker verified and committed for this job: None when the broker said
    # nothing (older broker), "" when it has none (start from scratch), else that directory's URI.
    restore_from: str | None = None
    # The job's place in its gang (a single-node job is a gang of one); None from a broker that
    # predates it, and then no gang variables are set.
    gang: Gang | None = None
    # The container image the job runs in (agent/runtimes.py), checked; None: it runs on the host.
    image: str | None = None
    # Copied onto the node by the job's own process before its command (agent/jobfiles.py).
    files: tuple[JobFile, ...] = ()

    @classmethod
    def from_json(cls, data: Any) -> "Assignment":
        if not isinstance(data, dict):
            raise AssignmentInvalid("assignment is not a JSON object")
        try:
            assignment_id = str(data["id"])
            job_id = str(data["job_id"])
            epoch = int(data["epoch"])
        except (KeyError, TypeError, ValueError) as err:
            raise AssignmentInvalid(f"missing or bad field: {err}") from None
        action = str(data.get("action") or "start")
        if action not in ACTIONS:
            raise AssignmentInvalid(f"unknown action {action!r}")
        indices = data.get("gpu_indices") or []
        if not isinstance(indices, list) or not all(isinstance(i, int) and i >= 0 for i in indices):
            raise AssignmentInvalid("gpu_indices must be a list of GPU indices")
        if len(set(indices)) != len(indices):
            raise AssignmentInvalid("gpu_indices lists a GPU twice")
        uuids = data.get("gpu_uuids")
        if uuids is not None and (not isinstance(uuids, list) or len(uuids) != len(indices)):
            raise AssignmentInvalid("gpu_uuids must list one UUID per entry of gpu_indices")
        gpu_milli = data.get("gpu_milli", 1000)
        if not isinstance(gpu_milli, int) or not 0 < gpu_milli <= 1000:
            raise AssignmentInvalid("gpu_milli must be a whole number from 1 to 1000")
        try:
            image = None if data.get("image") in (None, "") else image_reference(data["image"])
        except ImageInvalid as err:
            raise AssignmentInvalid(str(err)) from None
        command = data.get("command")
        if isinstance(command, list) and command and all(isinstance(c, str) for c in command):
            command = tuple(command)
        elif image is not None and command in (None, []):
            command = ()  # the image's own entrypoint
        elif not (isinstance(command, str) and command.strip()) and action == "start":
            raise AssignmentInvalid("command must be a non-empty argv list or shell string")
        restore_from = data.get("restore_from")
        if restore_from is not None and (not isinstance(restore_from, str) or "\x00" in restore_from):
            raise AssignmentInvalid("restore_from must be a string (a checkpoint URI, or empty)")
        env = data.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise AssignmentInvalid("env must map names to string values")
        try:
            gang = None if data.get("gang") is None else Gang.from_json(data["gang"])
            files = parse_files(data.get("files"), image=image is not None)
        except ValueError as err:
            raise AssignmentInvalid(str(err)) from None
        return cls(
            id=assignment_id,
            job_id=job_id,
            epoch=epoch,
            action=action,
            gpu_indices=tuple(indices),
            gpu_uuids=None if uuids is None else tuple(str(u) for u in uuids),
            gpu_milli=gpu_milli,
            command=command if command is not None else (),
            env=dict(env),
            checkpoint_uri=data.get("checkpoint_uri") or None,
            checkpoint_request_id=None if data.get("checkpoint_request_id") is None else str(data["checkpoint_request_id"]),
            restore_from=restore_from,
            gang=gang,
            image=image,
            files=files,
        )


@dataclass(frozen=True)
class JobExit:
    assignment_id: str
    job_id: str
    epoch: int
    state: str  # exited | failed | stopped
    exit_code: int | None
    message: str
    reason: str  # exit | exit_code | signal | requested | withdrawn | agent_shutdown | new_node
    gpu_indices: tuple[int, ...] = ()
    # The end of the job's output, so its owner can see why it failed without a shell on the node.
    output_tail: str = ""


@dataclass
class RunningJob:
    assignment: Assignment
    process: subprocess.Popen[bytes]
    workdir: Path
    main_pid: int | None = None  # the job's own first process (the shim's child), for SIGUSR1
    stop_reason: str | None = None
    stop_code: str | None = None
    kill_at: float | None = None
    checkpoint_requests: list[str] = field(default_factory=list)
    container: str | None = None  # the podman/docker container's name: a stop must end it, not only its client

    @property
    def pid(self) -> int:
        return self.process.pid


def job_environment(
    assignment: Assignment, *, workdir: Path, node_id: str | None, base_env: Mapping[str, str],
    user: JobUser | None = None,
) -> dict[str, str]:
    env = {
        k: v
        for k, v in base_env.items()
        if not k.startswith(_AGENT_ONLY_ENV_PREFIXES) and k not in _AGENT_ONLY_ENV and k not in GANG_ENV
    }
    for key, value in assignment.env.items():
        if key in RESERVED_ENV:
            log.warning("assignment %s: ignoring env %s, the agent sets it", assignment.id, key)
            continue
        env[key] = value
    env.update(
        {
            # NVML numbers GPUs in PCI bus order; CUDA's default order is "fastest first". Making
            # CUDA use PCI order too means index N is the same GPU for the broker and for the job.
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in assignment.gpu_indices),
            "WHALEZEN_JOB_ID": assignment.job_id,
            "WHALEZEN_ASSIGNMENT_ID": assignment.id,
            "WHALEZEN_EPOCH": str(assignment.epoch),
            "WHALEZEN_WORK_DIR": str(workdir),
            "WHALEZEN_CHECKPOINT_REQUEST_FILE": str(workdir / CHECKPOINT_REQUEST_FILE),
        }
    )
    if user is not None:  # who the job is, not who the agent is (HOME=/root would be unwritable)
        env.update({"HOME": job_home(user, workdir), "USER": user.name, "LOGNAME": user.name})
    if node_id:
        env["WHALEZEN_NODE_ID"] = node_id
    if assignment.checkpoint_uri:
        env["WHALEZEN_CHECKPOINT_URI"] = assignment.checkpoint_uri
    if assignment.restore_from is not None:  # "" too: "nothing committed" is an instruction as well
        env["WHALEZEN_RESTORE_FROM"] = assignment.restore_from
    if assignment.gang is not None:
        env.update(assignment.gang.environment())
    return env


class JobRunner:
    def __init__(
        self,
        jobs_dir: Path,
        *,
        base_env: Mapping[str, str] | None = None,
        stop_grace_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        job_user: JobUser | None = None,
        runtimes: Sequence[Runtime] = (),
        server_url: str = "",
    ) -> None:
        self.jobs_dir = Path(jobs_dir)
        self.server_url = server_url  # where a job's `upload:` files come from (agent/fetch.py)
        self.runtimes = tuple(runtimes)  # image jobs run through the first (agent/runtimes.py)
        self.job_user = job_user or resolve_job_user(None)
        self._root_ready = False
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.stop_grace_s = stop_grace_s
        self._clock = clock
        self._running: dict[str, RunningJob] = {}

    def prepare(self) -> None:
        """Create the work root (raises ValueError for one that is not the agent's own)."""
        if not self._root_ready:
            prepare_work_root(self.jobs_dir, self.job_user)
            self._root_ready = True

    @property
    def running(self) -> Mapping[str, RunningJob]:
        return self._running

    def busy_gpus(self) -> set[int]:
        return {i for job in self._running.values() for i in job.assignment.gpu_indices}

    def workdir_of(self, assignment_id: str) -> Path:
        """The job's working directory (also after it exited: its notice and log stay there)."""
        return self.jobs_dir / _safe_name(assignment_id)

    def start(self, assignment: Assignment, *, node_id: str | None) -> RunningJob:
        self.prepare()
        workdir = self.workdir_of(assignment.id)
        try:
            make_job_dir(workdir, self.job_user)
        except OSError as err:
            raise JobStartError(f"cannot make the job's work dir {workdir}: {err.strerror or err}") from None
        env = job_environment(assignment, workdir=workdir, node_id=node_id, base_env=self.base_env,
                              user=self.job_user)
        argv = ["/bin/sh", "-c", assignment.command] if isinstance(assignment.command, str) else list(assignment.command)
        as_job_user, container = True, None
        entries, mounts = plan(assignment.files, workdir=workdir)
        if assignment.image is not None:
            argv, env, as_job_user, container = self._container(assignment, argv, env, workdir, mounts)
        if entries:
            argv = self._with_files(assignment, argv, entries, workdir, env, as_job_user=as_job_user)
        status_r, status_w = os.pipe()
        try:
            # O_NOFOLLOW: the folder is the job user's; never write through a link it left there.
            log_fd = os.open(workdir / "job.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            os.close(status_r)
            os.close(status_w)
            raise JobStartError(f"cannot open the job's log: {err.strerror or err}") from None
        try:
            process = subprocess.Popen(
                self._shim_argv(status_w, argv, as_job_user=as_job_user),
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(status_w,),
            )
        except OSError as err:
            os.close(status_r)
            raise JobStartError(f"cannot start the job shim: {err.strerror or err}") from None
        finally:
            os.close(log_fd)  # the child has its own copies
            os.close(status_w)
        try:
            main_pid = self._await_shim(process, status_r, argv)
        finally:
            os.close(status_r)
        job = RunningJob(assignment=assignment, process=process, workdir=workdir, main_pid=main_pid,
                         container=container)
        self._running[assignment.id] = job
        log.info("assignment %s: started pid %d (group %d) as %s on GPUs %s%s", assignment.id, main_pid, process.pid,
                 self.job_user.name, ",".join(map(str, assignment.gpu_indices)),
                 f" in image {assignment.image} ({argv[0]})" if assignment.image else "")
        return job

    def _with_files(self, assignment: Assignment, argv: list[str], entries: list[dict[str, Any]], workdir: Path,
                    env: Mapping[str, str], *, as_job_user: bool) -> list[str]:
        """agent/fetch.py in front of `argv` (the runtime's, for an image job: the files are on the
        host before the container starts). `~` is the HOME the job sees; an image job's is its work dir."""
        home = str(workdir) if assignment.image is not None else env.get("HOME", str(workdir))
        try:
            return with_fetch(argv, entries, workdir=workdir, home=home, server=self.server_url, user=self.job_user,
                              as_job_user=as_job_user)
        except (OSError, ValueError) as err:
            raise JobStartError(str(err)) from None

    def _container(self, assignment: Assignment, argv: list[str], env: dict[str, str], workdir: Path,
                   mounts: Sequence[Any] = ()) -> tuple[list[str], dict[str, str], bool, str | None]:
        """The runtime's argv for an image job, its client's env, whether the client runs as the job
        user, and the container's name. Never the host: no runtime is a JobStartError."""
        if not self.runtimes:
            raise JobStartError(f"the job runs in image {assignment.image}, and this node has no container runtime "
                                "(podman, docker or apptainer)")
        host = {k: v for k, v in self.base_env.items()
                if not k.startswith(_AGENT_ONLY_ENV_PREFIXES) and k not in _AGENT_ONLY_ENV}
        # The job's own variables are what job_environment added or changed, less who the job user is
        # on the host (HOME, USER, LOGNAME mean nothing inside an image).
        job_env = {k: v for k, v in env.items() if k in assignment.env or (
            host.get(k) != v and k not in ("HOME", "USER", "LOGNAME"))}
        runtime = self.runtimes[0]
        client = dict(host)
        if runtime.name in ("apptainer", "singularity"):  # it runs as the job user: its HOME, not the agent's
            client.update({k: env[k] for k in ("HOME", "USER", "LOGNAME") if k in env})
        try:
            command = container_command(
                runtime, image=str(assignment.image), command=argv if assignment.command else [], job_env=job_env,
                client_env=client, workdir=workdir, assignment_id=assignment.id, gpu_indices=assignment.gpu_indices,
                gpu_uuids=assignment.gpu_uuids, uid=self.job_user.uid, gid=self.job_user.gid,
                agent_is_root=os.geteuid() == 0, mounts=[(str(m.host), m.container) for m in mounts])
        except ValueError as err:
            raise JobStartError(str(err)) from None
        if command.name is not None:
            remove_container(self.runtimes, command.name)  # one a crashed agent left would block the name
        return command.argv, command.env, command.run_as_job_user, command.name

    def clean_container(self, assignment_id: str) -> None:
        """Remove the container an assignment may have left (an agent that died while it ran)."""
        if any(r.oci for r in self.runtimes):
            remove_container(self.runtimes, container_name(assignment_id))

    def _shim_argv(self, status_fd: int, argv: list[str], *, as_job_user: bool = True) -> list[str]:
        shim = [sys.executable, "-I", "-S", str(JOBSHIM), "--parent", str(os.getpid()), "--status-fd",
                str(status_fd), "--grace", str(self.stop_grace_s)]
        # docker's and rootful podman's clients are the agent's: the socket they use is root to anyone
        # who can reach it, so the job user never gets it (the container runs as the job user).
        if self.job_user.separate and as_job_user:
            shim += ["--uid", str(self.job_user.uid), "--gid", str(self.job_user.gid)]
        return [*shim, "--", *argv]

    def _await_shim(self, process: subprocess.Popen[bytes], status_r: int, argv: list[str]) -> int:
        """The shim's one line: `started PID` or `error ERRNO`. Raises JobStartError."""
        deadline = time.monotonic() + SHIM_START_TIMEOUT_S
        answer = b""
        while not answer.endswith(b"\n") and time.monotonic() < deadline:
            ready, _, _ = select.select([status_r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(status_r, 64)
            if not chunk:
                break  # the shim died before it could tell
            answer += chunk
        word, _, value = answer.decode(errors="replace").strip().partition(" ")
        if word == "started" and value.isdigit():
            return int(value)
        _signal_group(process, signal.SIGKILL)
        code = process.wait()
        if word == "error" and value.isdigit():
            raise JobStartError(f"cannot start {argv[0]!r}: {os.strerror(int(value)) if int(value) else 'failed'}")
        raise JobStartError(f"the job shim did not start the job (exit status {code})")

    def request_checkpoint(self, assignment_id: str, *, request_id: str, checkpoint_uri: str | None) -> str | None:
        """Write the request file, then SIGUSR1 the job if it handles it.

        Returns "signalled", "file_only" (the job has no SIGUSR1 handler: it must poll the file) or
        None when there is nothing to do (not running, or this request was already delivered).
        """
        job = self._running.get(assignment_id)
        if job is None or request_id in job.checkpoint_requests:
            return None
        request = {
            "request_id": request_id,
            "assignment_id": assignment_id,
            "job_id": job.assignment.job_id,
            "checkpoint_uri": checkpoint_uri or job.assignment.checkpoint_uri,
            "requested_at": time.time(),
        }
        self._write_request(job.workdir, request)
        job.checkpoint_requests.append(request_id)
        target = job.main_pid or job.pid
        if not catches_signal(target, signal.SIGUSR1):
            return "file_only"
        try:
            os.kill(target, signal.SIGUSR1)
        except ProcessLookupError:
            return "file_only"
        return "signalled"

    def _write_request(self, workdir: Path, request: dict[str, Any]) -> None:
        # mkstemp creates a fresh name with O_EXCL (never through a link the job planted); the
        # rename replaces whatever is at the final name, never a link's target. Whole or nothing.
        fd, tmp = tempfile.mkstemp(dir=workdir, prefix=".checkpoint-request.")
        try:
            if self.job_user.separate:
                os.fchown(fd, self.job_user.uid, self.job_user.gid)
            with os.fdopen(fd, "w") as handle:
                json.dump(request, handle)
            os.replace(tmp, workdir / CHECKPOINT_REQUEST_FILE)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def stop(self, assignment_id: str, *, reason: str, code: str = "requested") -> None:
        """SIGTERM the job's process group; SIGKILL follows in poll() after the grace period.
        `code` says why, for the broker: requested | withdrawn | agent_shutdown | new_node."""
        job = self._running.get(assignment_id)
        if job is None or job.stop_reason is not None:
            return
        job.stop_reason = reason
        job.stop_code = code
        job.kill_at = self._clock() + self.stop_grace_s
        _signal_group(job.process, signal.SIGTERM)

    def poll(self) -> list[JobExit]:
        """Reap finished jobs; SIGKILL those that ignored SIGTERM past their grace period."""
        exits: list[JobExit] = []
        now = self._clock()
        for assignment_id, job in list(self._running.items()):
            code = job.process.poll()
            if code is None:
                if job.kill_at is not None and now >= job.kill_at:
                    _signal_group(job.process, signal.SIGKILL)
                    if job.container:  # the daemon owns the container: killing its client does not end it
                        remove_container(self.runtimes, job.container)
                continue
            # The main process is gone; take down anything it left behind in its session.
            _signal_group(job.process, signal.SIGKILL)
            if job.container and (job.stop_reason is not None or code < 0):
                remove_container(self.runtimes, job.container)  # its client ended, the container may not have
            del self._running[assignment_id]
            exits.append(_exit_of(job, code))
        return exits

    def stop_all(self, *, reason: str, wait: Callable[[float], Any] = time.sleep) -> list[JobExit]:
        for assignment_id in list(self._running):
            self.stop(assignment_id, reason=reason, code="agent_shutdown")
        exits: list[JobExit] = []
        deadline = self._clock() + self.stop_grace_s + 5.0
        while self._running and self._clock() < deadline:
            exits.extend(self.poll())
            if self._running:
                wait(0.05)
        return exits


OUTPUT_TAIL_BYTES = 4000


def output_tail(workdir: Path, limit: int = OUTPUT_TAIL_BYTES) -> str:
    """The last `limit` bytes of the job's combined stdout/stderr (job.log), decoded leniently."""
    try:
        # The job may have replaced job.log with a link to a file only the agent can read (its
        # tail would go to the job's owner) or a FIFO (a read would block the agent): regular
        # files only, never through a link.
        fd = os.open(workdir / "job.log", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        size = os.fstat(fd).st_size
        handle.seek(max(0, size - limit))
        return handle.read(limit).decode("utf-8", errors="replace")


def _exit_of(job: RunningJob, code: int) -> JobExit:
    a = job.assignment
    tail = output_tail(job.workdir)
    if job.stop_reason is not None:
        how = f"exit code {code}" if code >= 0 else f"signal {_signal_name(-code)}"
        return JobExit(a.id, a.job_id, a.epoch, "stopped", code, f"{job.stop_reason} ({how})",
                       job.stop_code or "requested", a.gpu_indices, tail)
    if code == 0:
        return JobExit(a.id, a.job_id, a.epoch, "exited", 0, "exited with code 0", "exit", a.gpu_indices, tail)
    if code < 0:
        return JobExit(a.id, a.job_id, a.epoch, "failed", code, f"killed by signal {_signal_name(-code)}", "signal",
                       a.gpu_indices, tail)
    fetch = fetch_failure(tail) if a.files and code == 125 else None
    if fetch is not None:  # agent/fetch.py: the job's command never ran
        return JobExit(a.id, a.job_id, a.epoch, "failed", code, f"fetching the job's files failed: {fetch}",
                       "exit_code", a.gpu_indices, tail)
    if job.container and code == 125:  # podman's and docker's own failure: the image never ran (pull, GPUs...)
        return JobExit(a.id, a.job_id, a.epoch, "failed", code, f"the container runtime could not run image "
                       f"{a.image} (exit code 125; its output says why)", "exit_code", a.gpu_indices, tail)
    return JobExit(a.id, a.job_id, a.epoch, "failed", code, f"exited with code {code}", "exit_code", a.gpu_indices,
                   tail)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)  # start_new_session made the job its group's leader
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _safe_name(assignment_id: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in assignment_id)
    return cleaned.strip(".") or "assignment"
