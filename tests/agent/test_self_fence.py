"""Issue 8 item 6: an agent cut off from the broker for longer than --fence-after-seconds stops its
jobs itself, so the broker's bounded wait before restarting them elsewhere never lets two copies run.

The loop is driven step by step with a fake clock (tests/agent/test_loop.py's helpers); the jobs
are real processes. One short test runs the agent as a real process with the setting from its
environment.
"""
from __future__ import annotations

import json
import logging
import signal

import pytest

from agent import cli
from agent.loop import AgentConfig
from agent.procs import process_start_ticks
from tests.agent import jobscripts
from tests.agent.test_cli import running_agent, sigterm, wait_for
from tests.agent.test_loop import make_agent, pump, start_assignment, states

FENCE_AFTER_S = 120.0


def two_running_jobs(open_dir, broker, clock, **config):
    """An agent running a polite job (a1) and one that ignores SIGTERM (a2), both ready. Its backoff
    cap is short so that it gets through within 2 s once the broker answers again."""
    config.setdefault("backoff_cap_s", 2.0)
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER),
                                start_assignment(id="a2", job_id="j2", gpu_indices=[0], command=jobscripts.STUBBORN)]
    agent = make_agent(open_dir, broker, clock, **config)
    agent.step()
    jobs = open_dir / "state-jobs"
    pump(agent, clock, lambda: (jobs / "a1" / "ready").exists() and (jobs / "a2" / "ready").exists(),
         what="both jobs ready", advance=0.2)
    return agent, {aid: job.pid for aid, job in agent.runner.running.items()}


def last_accepted_heartbeat(agent, broker, clock) -> float:
    """Step until the broker accepts one more heartbeat; the fake time at which it did."""
    seen = len(broker.state.heartbeats)
    pump(agent, clock, lambda: len(broker.state.heartbeats) > seen, what="a heartbeat")
    return clock.now


def silent_until(agent, clock, t: float) -> None:
    """Step through the silence up to fake time `t`, as the loop would (at most 10 s apart)."""
    while clock.now < t:
        clock.advance(min(10.0, t - clock.now))
        agent.step()


def alive(pid: int) -> bool:
    return process_start_ticks(pid) is not None


def stop_jobs(agent, clock) -> None:
    """End the test's jobs through the runner (shutdown() would wait for real time on a fake clock)."""
    for assignment_id in list(agent.runner.running):
        agent.runner.stop(assignment_id, reason="test over")
    pump(agent, clock, lambda: not agent.runner.running, what="jobs stopped")


def test_cut_off_past_fence_after_stops_every_job_and_queues_fenced_reports(open_dir, broker, clock, caplog):
    agent, pids = two_running_jobs(open_dir, broker, clock, fence_after_s=FENCE_AFTER_S, stop_grace_s=1.0)
    heard = last_accepted_heartbeat(agent, broker, clock)
    broker.stop()  # a partition: every call is refused from now on
    silent_until(agent, clock, heard + FENCE_AFTER_S - 1)
    assert all(alive(pid) for pid in pids.values()) and agent.state.outbox == []

    caplog.set_level(logging.ERROR, logger="agent.selffence")
    silent_until(agent, clock, heard + FENCE_AFTER_S)
    # SIGTERM now; the job that ignores it is SIGKILLed once the (fake) grace has passed.
    pump(agent, clock, lambda: len(agent.state.outbox) == 2, what="both stops queued", advance=0.5)
    assert not any(alive(pid) for pid in pids.values())
    assert agent.runner.running == {}
    saved = json.loads((open_dir / "state" / "state.json").read_text())["outbox"]  # survives a restart
    assert sorted((r["assignment_id"], r["state"], r["reason"]) for r in saved) == [
        ("a1", "stopped", "fenced"), ("a2", "stopped", "fenced")]
    stubborn = next(r for r in saved if r["assignment_id"] == "a2")
    assert stubborn["exit_code"] == -signal.SIGKILL
    for report in saved:
        assert "accepted no call from this agent for 120 s (fence-after 120 s)" in report["message"]
    (logged,) = [r.getMessage() for r in caplog.records if "stopping 2 job(s)" in r.getMessage()]
    assert "cannot run twice" in logged


def test_fenced_reports_are_delivered_when_the_broker_answers_again(open_dir, broker, clock):
    agent, _ = two_running_jobs(open_dir, broker, clock, fence_after_s=FENCE_AFTER_S, stop_grace_s=1.0)
    heard = last_accepted_heartbeat(agent, broker, clock)
    broker.stop()
    silent_until(agent, clock, heard + FENCE_AFTER_S + 30)
    pump(agent, clock, lambda: len(agent.state.outbox) == 2, what="both stops queued", advance=0.5)
    before = len(broker.state.requests)
    broker.start()
    # The broker still lists both as `start` (it has not heard yet): they must not start again here.
    pump(agent, clock, lambda: ("POST", "/api/v1/agent/heartbeat") in broker.state.requests[before:],
         what="contact again")
    assert states(broker, "a1") == ["running", "stopped"] and states(broker, "a2") == ["running", "stopped"]
    assert {broker.statuses_for(a)[-1]["reason"] for a in ("a1", "a2")} == {"fenced"}
    paths = [p for _, p in broker.state.requests[before:]]
    assert paths.index("/api/v1/agent/heartbeat") > max(
        paths.index("/api/v1/agent/assignments/a1/status"), paths.index("/api/v1/agent/assignments/a2/status"))
    assert agent.state.outbox == []
    for _ in range(3):
        clock.advance(5)
        agent.step()
    assert agent.runner.running == {} and broker.state.heartbeats[-1]["processes"] == []


def test_an_outage_shorter_than_fence_after_touches_no_job(open_dir, broker, clock):
    agent, pids = two_running_jobs(open_dir, broker, clock, fence_after_s=FENCE_AFTER_S)
    for _ in range(2):  # two outages in a row, each just short of the limit: contact resets the clock
        heard = last_accepted_heartbeat(agent, broker, clock)
        broker.stop()
        silent_until(agent, clock, heard + FENCE_AFTER_S - 10)
        broker.start()
        assert all(alive(pid) for pid in pids.values())
    last_accepted_heartbeat(agent, broker, clock)
    assert sorted(agent.runner.running) == ["a1", "a2"]
    assert all(job.stop_reason is None for job in agent.runner.running.values())
    assert states(broker, "a1") == ["running"] and states(broker, "a2") == ["running"]
    assert sorted(p["assignment_id"] for p in broker.state.heartbeats[-1]["processes"]) == ["a1", "a2"]
    stop_jobs(agent, clock)


def test_a_broker_that_answers_with_errors_does_not_count_as_contact(open_dir, broker, clock):
    agent, pids = two_running_jobs(open_dir, broker, clock, fence_after_s=FENCE_AFTER_S, stop_grace_s=1.0)
    heard = last_accepted_heartbeat(agent, broker, clock)
    broker.state.fail_with = 503  # up, but accepting nothing
    silent_until(agent, clock, heard + FENCE_AFTER_S)
    pump(agent, clock, lambda: len(agent.state.outbox) == 2, what="both stops queued", advance=0.5)
    assert not any(alive(pid) for pid in pids.values())


def test_fence_after_zero_never_stops_a_job(open_dir, broker, clock):
    agent, pids = two_running_jobs(open_dir, broker, clock, fence_after_s=0)
    heard = last_accepted_heartbeat(agent, broker, clock)
    broker.stop()
    silent_until(agent, clock, heard + 24 * 3600)
    assert all(alive(pid) for pid in pids.values()) and agent.state.outbox == []
    stop_jobs(agent, clock)


# -- the setting ---------------------------------------------------------------------------------
def test_default_is_900_s_and_the_environment_or_the_flag_changes_it(monkeypatch):
    assert AgentConfig(server_url="http://x", join_token=None, name="n", state_dir=None).fence_after_s == 900
    monkeypatch.delenv("WHALEZEN_AGENT_FENCE_AFTER_SECONDS", raising=False)
    assert cli._run_parser().parse_args(["--server", "http://x"]).fence_after_seconds == 900
    monkeypatch.setenv("WHALEZEN_AGENT_FENCE_AFTER_SECONDS", "0")
    assert cli._run_parser().parse_args(["--server", "http://x"]).fence_after_seconds == 0
    args = cli._run_parser().parse_args(["--server", "http://x", "--fence-after-seconds", "1200"])
    assert args.fence_after_seconds == 1200


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_fence_after_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli._run_parser().parse_args(["--server", "http://x", "--fence-after-seconds", value])
    assert exit_.value.code == cli.EXIT_USAGE
    assert "--fence-after-seconds: expected a number of seconds (0 or more)" in capsys.readouterr().err


def test_a_real_agent_process_fences_with_the_setting_from_its_environment(broker, open_dir):
    broker.state.heartbeat_seconds = 1
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER, gpu_indices=[0])]
    with running_agent("--server", broker.url, "--fake-gpus", "1xL4", "--name", "edge-f",
                       "--state-dir", str(open_dir / "state"), "--stop-grace-seconds", "1",
                       env={"WHALEZEN_JOIN_TOKEN": "join-secret", "WHALEZEN_AGENT_FENCE_AFTER_SECONDS": "3"}) as proc:
        wait_for(lambda: (open_dir / "state-jobs" / "a1" / "ready").exists(), "the job to run")
        (pid,) = [s["pid"] for s in broker.statuses_for("a1") if s["state"] == "running"]
        broker.stop()
        wait_for(lambda: not alive(pid), "the job to be stopped by its cut-off agent", limit_s=30)
        assert proc.poll() is None  # the agent itself runs on and keeps trying
        broker.start()
        wait_for(lambda: len(broker.statuses_for("a1")) >= 2, "the fenced report", limit_s=30)
        assert broker.statuses_for("a1")[-1]["reason"] == "fenced"
        err = sigterm(proc)
    assert proc.returncode == 0
    assert "stopping 1 job(s): a1" in err and "Traceback" not in err
