"""The agent's main loop: register, heartbeat, pull assignments, run them, report, survive outages.

One thread does everything in `step()`, which never sleeps itself; `run()` sleeps between steps on
an Event, so SIGTERM (which sets it) ends the loop at once. Tests drive `step()` with a fake clock.

Ordering rules that keep the broker's view right:
- Status reports go through a persisted outbox, in order, before each heartbeat, so a broker
  that comes back first hears how jobs ended, then sees the node's current state.
- The broker raises the node's epoch on every change of its assignments. The agent keeps the
  highest epoch it has seen in any answer, on disk; an assignments answer with a lower epoch is a
  stale view (lagging replica, replayed answer): what is new in it is refused, nothing else moves.
- The assignments list is the node's whole desired state: a running job missing from a current
  list is stopped. That fences work the broker took away (node marked lost, job moved).
- Cut off from the broker past `--fence-after-seconds`, the agent stops its jobs itself, so the
  broker's bounded wait before restarting them elsewhere holds (agent/selffence.py).
"""
from __future__ import annotations

import logging
import os
import random
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.backends.base import GpuBackend
from agent.backoff import Backoff
from agent.client import BrokerAuthError, BrokerClient, BrokerRejected, BrokerUnavailable
from agent.isolation import check_work_dir, default_work_dir, log_job_isolation, resolve_job_user
from agent.jobs import Assignment, AssignmentInvalid, JobExit, JobRunner, JobStartError
from agent.jointoken import delete_token_file
from agent.model import GpuReading, Health
from agent.notices import NoticeWatcher
from agent.procs import kill_orphan, process_start_ticks
from agent.protocol import heartbeat_payload, registration_payload
from agent.runtimes import detect as detect_runtimes, log_runtimes
from agent.selffence import DEFAULT_FENCE_AFTER_S, SelfFence
from agent.spot import POLL_SECONDS as SPOT_POLL_SECONDS, SpotWatcher
from agent.state import AgentState, Identity, JobRecord, StateStore

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 5.0


class RegistrationRefused(RuntimeError):
    """The broker rejected the join token (or the request): retrying cannot help."""


@dataclass(frozen=True)
class AgentConfig:
    server_url: str
    join_token: str | None
    name: str
    state_dir: Path
    heartbeat_seconds: float | None = None  # None: what the broker says at registration
    tick_seconds: float = 0.5  # how often finished jobs are noticed between heartbeats
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    stop_grace_s: float = 10.0
    http_timeout_s: float = 10.0
    labels: dict[str, str] | None = None
    job_user: str | None = None  # user name/uid, "self", or None: the default (agent/isolation.py)
    work_dir: Path | None = None  # where job dirs go; None: `<state dir>-jobs`, never inside the state dir
    join_token_file: Path | None = None  # deleted once the node is registered (--delete-join-token-file)
    fence_after_s: float = DEFAULT_FENCE_AFTER_S  # stop every job after this long cut off; 0: never
    spot_notice: str = "none"  # none | aws | gcp | local: where to watch for spot interruption notices
    metadata_url: str | None = None  # the metadata service; None: the cloud's usual address (agent/spot.py)
    spot_poll_s: float = SPOT_POLL_SECONDS
    # Where the DCGM-named GPU metrics are served (agent/metrics.py): (host, port), port 0 = any free
    # one; None: not served (the CLI's default is loopback, any free port).
    metrics_listen: tuple[str, int] | None = None
    # The address a gang's peers reach this node at (--advertise-address); None: the broker uses
    # the address the registration came from (wrong behind NAT or a proxy).
    advertise_address: str | None = None
    # --container-runtime: None or "auto" detects podman/docker/apptainer; "none"; or names to pin
    # (agent/runtimes.py). What is found is what image jobs run with, and what registration reports.
    container_runtimes: str | None = None


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        backend: GpuBackend,
        *,
        client: BrokerClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        base_env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.client = client or BrokerClient(config.server_url, timeout_s=config.http_timeout_s)
        self.clock = clock
        self.store = StateStore(config.state_dir)
        self.state: AgentState = self.store.load_state()
        self.identity: Identity | None = self._load_identity()
        work_dir = config.work_dir or default_work_dir(config.state_dir)
        check_work_dir(work_dir, config.state_dir)  # raises ValueError: a usage error
        self.job_user = resolve_job_user(config.job_user)
        self.runtimes = detect_runtimes(config.container_runtimes,  # raises ValueError: a usage error
                                        simulated_gpus=getattr(backend, "name", "") == "fake")
        self.runner = JobRunner(work_dir, base_env=base_env, stop_grace_s=config.stop_grace_s, clock=clock,
                                job_user=self.job_user, runtimes=self.runtimes, server_url=config.server_url)
        self.runner.prepare()
        self.backoff = Backoff(base_s=config.backoff_base_s, cap_s=config.backoff_cap_s, rng=rng)
        self.fence = SelfFence(config.fence_after_s, clock)  # raises ValueError: a usage error
        # Stop request from a signal handler: a flag plus a byte down a pipe that the loop's select()
        # waits on. A threading.Event cannot be used there: the handler runs on the main thread,
        # possibly while Event.wait() holds the Event's lock, and set() would deadlock on it.
        self.stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.heartbeat_s = config.heartbeat_seconds or DEFAULT_HEARTBEAT_S
        self.last_sample: tuple[GpuReading, ...] = ()
        self.last_sample_at: float | None = None  # wall-clock time of last_sample
        self._sampled_mono: float | None = None
        self.missed_heartbeats = 0
        self.last_error: str | None = None
        self.broker_says_lost = False
        self.notices = NoticeWatcher()
        # Raises ValueError (a usage error) for `local` without a URL.
        self.spot = None if config.spot_notice == "none" else SpotWatcher(
            config.spot_notice, config.metadata_url, poll_s=config.spot_poll_s, on_notice=lambda _: self._wake())
        self._interruption_announced = False  # a heartbeat carrying the notice was delivered
        self.metrics: Any = None  # agent.metrics.GpuCollector while the GPU metrics are served
        self.metrics_server: Any = None
        self.metrics_url: str | None = None  # what the broker is told, for Prometheus service discovery
        self._next_network_at = clock()
        self._next_heartbeat_at = clock()
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Open the GPUs (raises GpuBackendUnavailable) and clean up after a crashed predecessor."""
        if self._started:
            return
        self.backend.start()
        self.backend.inventory()
        log_job_isolation(self.job_user, work_dir=self.runner.jobs_dir, state_dir=self.config.state_dir)
        log_runtimes(self.runtimes)
        # Before the first call to the broker: nothing a previous run left may keep running.
        self._fence_orphans()
        self.fence.log_setting()
        if self.spot is not None:
            self.spot.start()
        if self.config.metrics_listen is not None:
            self._start_metrics(*self.config.metrics_listen)
        self._started = True

    def _start_metrics(self, host: str, port: int) -> None:
        try:
            from agent.metrics import GpuCollector, MetricsServer  # prometheus_client: only when serving
        except ImportError as err:  # an install from before the exporter: the agent's real work goes on
            log.error("cannot serve GPU metrics (%s): pip install -r agent/requirements.txt", err)
            return
        inventory = self.backend.inventory()
        self.metrics = GpuCollector(inventory.hostname, inventory.gpus)
        try:
            self.metrics_server = MetricsServer(self.metrics, host, port)
        except OSError as err:  # the port is taken: the agent's real work goes on without it
            log.error("cannot serve GPU metrics on %s:%d: %s", host, port, err)
            self.metrics = None
            return
        self.metrics_url = self.metrics_server.url(inventory.hostname)
        log.info("GPU metrics (DCGM exporter names) at %s", self.metrics_url)

    def run(self) -> int:
        self.start()
        try:
            while not self.stopping:
                delay = self.step()
                if not self.stopping:
                    select.select([self._wake_r], [], [], delay)
                    _drain(self._wake_r)
        finally:
            self.shutdown()
        return 0

    def request_stop(self, *_: Any) -> None:
        """Signal handler for SIGTERM/SIGINT: only a flag and a wake-up byte; the loop does the work."""
        self.stopping = True
        self._wake()

    def _wake(self) -> None:
        """End the loop's current wait now (from a signal handler or the spot-notice thread)."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # the pipe is full of earlier wake-ups already

    def shutdown(self) -> None:
        """Stop every job (no process of ours may outlive the agent), report, release the GPUs."""
        log.info("stopping: %d job(s) to stop", len(self.runner.running))
        for exit_ in self.runner.stop_all(reason="agent shutting down"):
            self._record_exit(exit_)
        if self.identity is not None and self.state.outbox:
            try:
                self._flush_outbox()
            except (BrokerUnavailable, BrokerAuthError) as err:
                log.warning("could not deliver %d status report(s) before exit (%s); kept for next start",
                            len(self.state.outbox), err)
        self.store.save_state(self.state)
        self.backend.close()
        if self.spot is not None:
            self.spot.stop()  # before the wake pipe closes: its thread writes to it
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = self.metrics_url = None
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    # -- one iteration -----------------------------------------------------------------------
    def step(self) -> float:
        """Do what is due now; return how long to wait before the next step."""
        self.start()
        for exit_ in self.runner.poll():
            self._record_exit(exit_)
        for assignment_id, job in self.runner.running.items():
            self._report_checkpoint(assignment_id, job.assignment.job_id, job.assignment.epoch)
        now = self.clock()
        if self.spot is not None and self.spot.notice is not None and not self._interruption_announced:
            self._next_heartbeat_at = min(self._next_heartbeat_at, now)  # the broker has little time: tell it now
        self.fence.apply(self.runner, now)  # before any network wait: it must happen even in a long backoff
        if now >= self._next_heartbeat_at and (self._sampled_mono is None or now - self._sampled_mono >= self.heartbeat_s):
            self._sample(now)
        if now < self._next_network_at:
            return self._wait_until(self._next_network_at)
        try:
            if self.identity is None:
                self._register()
            self._flush_outbox()
            if now >= self._next_heartbeat_at:
                self._heartbeat()
                self._sync_assignments()
                self._flush_outbox()
                self._next_heartbeat_at = now + self.heartbeat_s
            self.backoff.reset()
            self.last_error = None
        except BrokerUnavailable as err:
            self._on_broker_down(now, str(err))
        except BrokerAuthError as err:
            if self.identity is None:
                raise RegistrationRefused(str(err)) from None
            # Our node token is no longer accepted (node deleted or token revoked): join again.
            log.error("broker refused our node token (%s); registering again with the join token", err)
            self.identity = None
            self.store.clear_identity()
            self._on_broker_down(now, str(err))
        # Sleep until the next heartbeat (at most a tick: finished jobs are noticed within one), or,
        # with reports still to deliver, until the broker may be tried again. (This once took
        # `max(next network try, now)` unconditionally, which is `now` while the broker answers: an
        # idle agent woke at once, forever, and used a quarter to all of a core.)
        wake = self._next_heartbeat_at
        if self.state.outbox:
            wake = min(wake, max(self._next_network_at, now))
        return self._wait_until(wake)

    def _wait_until(self, when: float) -> float:
        return max(0.0, min(self.config.tick_seconds, when - self.clock()))

    def _on_broker_down(self, now: float, reason: str) -> None:
        delay = self.backoff.next_delay()
        self._next_network_at = now + delay
        self.missed_heartbeats += 1 if now >= self._next_heartbeat_at else 0
        self._next_heartbeat_at = min(self._next_heartbeat_at, self._next_network_at)
        self.last_error = reason
        log.warning("%s; retrying in %.1fs (attempt %d)", reason, delay, self.backoff.failures)

    # -- broker calls ------------------------------------------------------------------------
    def _load_identity(self) -> Identity | None:
        identity = self.store.load_identity()
        if identity is not None and identity.server_url.rstrip("/") != self.config.server_url.rstrip("/"):
            log.warning("state dir belongs to broker %s, not %s: registering anew", identity.server_url,
                        self.config.server_url)
            return None
        return identity

    def _register(self) -> None:
        if not self.config.join_token:
            raise RegistrationRefused("this node is not registered yet and no join token was given (--join-token)")
        payload = registration_payload(
            inventory=self.backend.inventory(),
            join_token=self.config.join_token,
            name=self.config.name,
            agent_key=self.state.agent_key,
            labels=self.config.labels or {},
            job_isolation=self.job_user.isolation,
            metrics_url=self.metrics_url,
            address=self.config.advertise_address,
            container_runtimes=[r.name for r in self.runtimes],
        )
        try:
            body = self.client.register(payload)
        except BrokerRejected as err:
            raise RegistrationRefused(str(err)) from None
        try:
            identity = Identity(
                server_url=self.config.server_url,
                node_id=str(body["node_id"]),
                node_token=str(body["node_token"]),
                name=self.config.name,
            )
        except KeyError as err:
            raise BrokerUnavailable(f"registration answer lacks {err}") from None
        self.store.save_identity(identity)
        self.identity = identity
        self.fence.contact()
        if self.config.join_token_file is not None:  # it has done its job; a file nobody reads cannot leak
            delete_token_file(self.config.join_token_file)
        if self.state.node_id != identity.node_id:
            self._forget_previous_node(identity.node_id)
        self._see_epoch(body.get("epoch"))
        if self.config.heartbeat_seconds is None and body.get("heartbeat_seconds"):
            self.heartbeat_s = float(body["heartbeat_seconds"])
        log.info("registered as node %s (%d GPUs)", identity.node_id, len(self.backend.inventory().gpus))

    def _sample(self, now: float) -> None:
        try:
            self.last_sample = self.backend.sample()
            self.last_sample_at = time.time()
            self._sampled_mono = now
            if self.metrics is not None:
                self.metrics.update(self.last_sample)
        except Exception:  # one bad sample must not stop heartbeats or job supervision
            log.exception("GPU sampling failed; sending the previous sample")

    def _heartbeat(self) -> None:
        assert self.identity is not None
        notice = self.spot.notice if self.spot is not None else None  # read once: the thread may set it
        payload = heartbeat_payload(
            readings=self.last_sample,
            sampled_at=self.last_sample_at,
            running=self.runner.running,
            max_epoch=self.state.max_epoch,
            missed_heartbeats=self.missed_heartbeats,
            last_error=self.last_error,
            interruption=notice.to_json() if notice is not None else None,
            metrics_url=self.metrics_url,
        )
        try:
            body = self.client.heartbeat(self.identity.node_token, payload)
        except BrokerRejected as err:
            if "interruption" not in payload:
                raise
            # A broker that predates the field refuses the whole heartbeat (strict validation):
            # losing the notice is better than losing the node's heartbeats two minutes early.
            log.error("broker refused the heartbeat with the spot notice (%s); sending heartbeats without it", err)
            if self.spot is not None:
                self.spot.stop()
                self.spot = None
            payload.pop("interruption")
            body = self.client.heartbeat(self.identity.node_token, payload)
            notice = None
        if notice is not None:
            self._interruption_announced = True
        self.fence.contact()
        self.missed_heartbeats = 0
        self._see_epoch(body.get("epoch"))
        lost = bool(body.get("lost"))
        if lost and not self.broker_says_lost:
            log.warning("broker had marked this node LOST; jobs it took away will be stopped at the next sync")
        self.broker_says_lost = lost
        if self.config.heartbeat_seconds is None and body.get("heartbeat_seconds"):
            self.heartbeat_s = float(body["heartbeat_seconds"])

    def _flush_outbox(self) -> None:
        assert self.identity is not None
        while self.state.outbox:
            report = self.state.outbox[0]
            payload = {k: v for k, v in report.items() if k != "assignment_id"}
            try:
                self.client.report_status(self.identity.node_token, report["assignment_id"], payload)
            except BrokerRejected as err:
                # The broker will never accept this one (assignment gone, transition invalid).
                log.warning("status report for %s dropped: %s", report["assignment_id"], err)
            self.state.outbox.pop(0)
            self.store.save_state(self.state)

    def _see_epoch(self, epoch: Any) -> None:
        if isinstance(epoch, int) and epoch > self.state.max_epoch:
            self.state.max_epoch = epoch
            self.store.save_state(self.state)

    def _forget_previous_node(self, node_id: str) -> None:
        """A different node id means a new epoch and assignment-id space (the old node was deleted,
        or this is another broker): jobs of the old node stop, its records are dropped."""
        for assignment_id in list(self.runner.running):
            self.runner.stop(assignment_id, reason="the node registered again under a new id", code="new_node")
        if self.state.node_id is not None:
            log.warning("registered as a new node %s (was %s): forgetting the old node's assignments",
                        node_id, self.state.node_id)
        self.state.node_id = node_id
        self.state.max_epoch = 0
        self.state.jobs = {aid: rec for aid, rec in self.state.jobs.items() if rec.state == "running"}
        self.store.save_state(self.state)

    # -- assignments -------------------------------------------------------------------------
    def _sync_assignments(self) -> None:
        assert self.identity is not None
        body = self.client.assignments(self.identity.node_token)
        raw_list = body.get("assignments")
        if not isinstance(raw_list, list):
            raise BrokerUnavailable("assignments answer has no list")
        epoch = body.get("epoch")
        epoch = epoch if isinstance(epoch, int) else self.state.max_epoch
        if epoch < self.state.max_epoch:
            # A view older than one we already had (a lagging replica, a replayed answer): acting
            # on it could start work on GPUs that were given to someone else since. Refuse what is
            # new in it and change nothing else.
            for raw in raw_list:
                if isinstance(raw, dict) and raw.get("id") is not None and str(raw["id"]) not in self.runner.running:
                    self._refuse_once(str(raw["id"]), str(raw.get("job_id", "")), _int(raw.get("epoch")),
                                      f"stale epoch {epoch}: this node has seen epoch {self.state.max_epoch}",
                                      reason="stale_epoch")
            return
        self._see_epoch(epoch)
        assignments: list[Assignment] = []
        for raw in raw_list:
            try:
                assignment = Assignment.from_json(raw)
                if assignment.epoch > epoch:
                    raise AssignmentInvalid(f"its epoch {assignment.epoch} is newer than the list's epoch {epoch}")
            except AssignmentInvalid as err:
                if isinstance(raw, dict) and raw.get("id") is not None:
                    self._refuse_once(str(raw["id"]), str(raw.get("job_id", "")), _int(raw.get("epoch")),
                                      f"invalid assignment: {err}", reason="invalid")
                continue
            assignments.append(assignment)
        listed = {a.id for a in assignments}
        # The list is the node's whole desired state: a running job missing from it was taken away
        # (released, or the node was marked lost and the job restarted elsewhere): fence it.
        for assignment_id in list(self.runner.running):
            if assignment_id not in listed:
                self.runner.stop(assignment_id, reason="assignment withdrawn by the broker", code="withdrawn")
        # Stops and checkpoints first, starts last, so a start can see which GPUs are being freed.
        for a in sorted(assignments, key=lambda a: (a.action == "start", a.epoch, a.id)):
            self._apply(a, listed)
        self.backend.note_busy_gpus(self.runner.busy_gpus())

    def _apply(self, a: Assignment, listed: set[str]) -> None:
        running = self.runner.running.get(a.id)
        record = self.state.jobs.get(a.id)
        if a.action == "stop":
            if running is not None:
                self.runner.stop(a.id, reason="stop requested by the broker")
            elif record is None:
                self._finish_unstarted(a, "stopped", "stopped before it started", reason="requested")
            return
        if a.action == "checkpoint":
            if running is not None:
                request_id = a.checkpoint_request_id or f"{a.id}@{a.epoch}"
                how = self.runner.request_checkpoint(a.id, request_id=request_id, checkpoint_uri=a.checkpoint_uri)
                if how is not None:
                    detail = "request file written, SIGUSR1 sent" if how == "signalled" else (
                        "request file written; the job has no SIGUSR1 handler, so no signal was sent")
                    self._queue(a.id, a.job_id, a.epoch, "checkpoint_requested", None,
                                f"checkpoint request {request_id}: {detail}", reason=how)
                    self._record_running(self.runner.running[a.id])
            elif record is None:
                self._finish_unstarted(a, "failed", "checkpoint requested but the job is not running on this node",
                                       reason="not_running")
            return
        # action == "start"
        if running is not None or record is not None:
            return  # already running, or already ran: never start an assignment twice
        problem, wait = self._gpu_problem(a, listed)
        if problem is None and a.image is not None and not self.runtimes:
            # Never on the host instead: the image is what the job needs (its libraries, its CUDA).
            problem = ("no_container_runtime", f"the job runs in image {a.image}, and this node has no container "
                       "runtime (podman, docker or apptainer)")
        if problem:
            self._refuse_once(a.id, a.job_id, a.epoch, problem[1], reason=problem[0])
            return
        if wait:
            log.info("assignment %s waits: %s", a.id, wait)
            return  # still listed next time; started once the GPUs are free
        try:
            job = self.runner.start(a, node_id=self.identity.node_id if self.identity else None)
        except JobStartError as err:
            self._finish_unstarted(a, "failed", str(err), reason="start_error")
            return
        # One save for the record and its report: an agent killed between two saves would leave a
        # running job the broker never hears started.
        self._record_running(job, save=False)
        self._queue(a.id, a.job_id, a.epoch, "running", None, f"started pid {job.pid}", reason="started",
                    pid=job.pid)

    def _gpu_problem(self, a: Assignment, listed: set[str]) -> tuple[tuple[str, str] | None, str | None]:
        """((code, message) to refuse, or None; reason to wait, or None).
        Waiting is for GPUs whose previous job is still stopping."""
        inventory = self.backend.inventory()
        by_index = {g.index: g for g in inventory.gpus}
        health = {r.index: r for r in self.last_sample}
        for position, index in enumerate(a.gpu_indices):
            gpu = by_index.get(index)
            if gpu is None:
                return ("gpu_missing", f"GPU {index} does not exist on this node ({len(by_index)} GPUs)"), None
            if a.gpu_uuids is not None and gpu.uuid != a.gpu_uuids[position]:
                return ("gpu_mismatch",
                        f"GPU {index} is {gpu.uuid}, not {a.gpu_uuids[position]} (GPU numbering changed?)"), None
            reading = health.get(index)
            if reading is not None and reading.health is Health.FAILED:
                return ("gpu_failed", f"GPU {index} is FAILED: {'; '.join(reading.health_reasons)}"), None
        wait = None
        for index in a.gpu_indices:
            holders = [job for job in self.runner.running.values() if index in job.assignment.gpu_indices]
            current = sum(j.assignment.gpu_milli for j in holders if j.assignment.id in listed and not j.stop_reason)
            if current + a.gpu_milli > 1000:
                return ("gpu_busy", f"GPU {index} is already in use by another assignment on this node"), None
            if sum(j.assignment.gpu_milli for j in holders) + a.gpu_milli > 1000:
                wait = f"GPU {index} is still held by a job that is stopping"
        return None, wait

    # -- bookkeeping -------------------------------------------------------------------------
    def _queue(self, assignment_id: str, job_id: str, epoch: int, state: str, exit_code: int | None,
               message: str, *, reason: str, pid: int | None = None,
               extra: dict[str, Any] | None = None) -> None:
        report: dict[str, Any] = {
            "assignment_id": assignment_id,
            "job_id": job_id,
            "epoch": epoch,
            "state": state,
            "exit_code": exit_code,
            "message": message,
            "reason": reason,
            "at": time.time(),
        }
        if pid is not None:
            report["pid"] = pid
        report.update(extra or {})
        self.state.queue_report(report)
        self.store.save_state(self.state)

    def _refuse_once(self, assignment_id: str, job_id: str, epoch: int, message: str, *, reason: str) -> None:
        if assignment_id in self.state.jobs:
            return
        log.warning("refusing assignment %s: %s", assignment_id, message)
        self.state.jobs[assignment_id] = JobRecord(assignment_id, job_id, epoch, "refused")
        self._queue(assignment_id, job_id, epoch, "refused", None, message, reason=reason)

    def _finish_unstarted(self, a: Assignment, state: str, message: str, *, reason: str) -> None:
        self.state.jobs[a.id] = JobRecord(a.id, a.job_id, a.epoch, state, gpu_indices=list(a.gpu_indices))
        self._queue(a.id, a.job_id, a.epoch, state, None, message, reason=reason)

    def _record_running(self, job: Any, *, save: bool = True) -> None:
        a = job.assignment
        previous = self.state.jobs.get(a.id)
        self.state.jobs[a.id] = JobRecord(
            a.id, a.job_id, a.epoch, "running", pid=job.pid, pid_start_ticks=process_start_ticks(job.pid),
            gpu_indices=list(a.gpu_indices), checkpoint_requests=list(job.checkpoint_requests),
            last_checkpoint_sha256=previous.last_checkpoint_sha256 if previous else None,
        )
        if save:
            self.store.save_state(self.state)

    def _report_checkpoint(self, assignment_id: str, job_id: str, epoch: int) -> None:
        """Queue a `checkpoint_written` report for a notice whose manifest the broker has not heard
        of. Only an extra report: the job's record keeps its state."""
        record = self.state.jobs.get(assignment_id)
        notice = self.notices.check(assignment_id, self.runner.workdir_of(assignment_id))
        if notice is None or record is None or notice.manifest_sha256 == record.last_checkpoint_sha256:
            return
        record.last_checkpoint_sha256 = notice.manifest_sha256  # saved by _queue, with the report
        self._queue(assignment_id, job_id, epoch, "checkpoint_written", None, f"checkpoint at step {notice.step}",
                    reason="written", extra={"checkpoint": notice.to_json()})

    def _record_exit(self, exit_: JobExit) -> None:
        # A job that saves and then exits at once (preemption) does so between two looks: its last
        # checkpoint goes to the broker before its exit does.
        self._report_checkpoint(exit_.assignment_id, exit_.job_id, exit_.epoch)
        self.notices.forget(exit_.assignment_id)
        record = self.state.jobs.get(exit_.assignment_id)
        if record is not None:
            record.state = exit_.state
            record.pid = None
        log.info("assignment %s: %s", exit_.assignment_id, exit_.message)
        failed_gpus: dict[str, list[str]] = {}
        if exit_.state == "failed":
            # A job that dies with its GPU (Xid 79, uncorrectable ECC) is not the user's fault: say so
            # in the report itself, because the heartbeat carrying the GPU's health comes after it.
            self._sample(self.clock())
            failed_gpus = {str(r.index): list(r.health_reasons) for r in self.last_sample
                           if r.index in exit_.gpu_indices and r.health is Health.FAILED}
        extra: dict[str, Any] = {"failed_gpus": failed_gpus} if failed_gpus else {}
        if exit_.output_tail:
            extra["output_tail"] = exit_.output_tail
        self._queue(exit_.assignment_id, exit_.job_id, exit_.epoch, exit_.state, exit_.exit_code, exit_.message,
                    reason=exit_.reason, extra=extra or None)
        self.backend.note_busy_gpus(self.runner.busy_gpus())

    def _fence_orphans(self) -> None:
        """A predecessor that crashed may have left jobs running that nobody supervises: stop them."""
        for record in list(self.state.jobs.values()):  # each report saves state, which prunes old records
            if record.state != "running":
                continue
            killed = kill_orphan(record.pid, record.pid_start_ticks, grace_s=self.config.stop_grace_s)
            self.runner.clean_container(record.assignment_id)  # a container outlives its killed client
            # A checkpoint it wrote while no agent watched still counts; one already reported
            # before the crash is not reported again (the record keeps its manifest sha).
            self._report_checkpoint(record.assignment_id, record.job_id, record.epoch)
            self.notices.forget(record.assignment_id)
            record.state = "failed"
            record.pid = None
            how = "its process was stopped" if killed else "its process was already gone"
            self._queue(record.assignment_id, record.job_id, record.epoch, "failed", None,
                        f"agent restarted while the job ran; {how} and its exit status is unknown",
                        reason="agent_crashed")
        self.store.save_state(self.state)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


__all__ = ["Agent", "AgentConfig", "RegistrationRefused"]
