"""Checkpoints a job writes reach the broker: one `checkpoint_written` report per save.

Jobs are real processes using the real helper (tests/agent/jobscripts.py CHECKPOINTING), run by the
real JobRunner under the agent loop against the in-test broker. Bad notices are planted by the
test in the job's own work dir, as a hostile job would.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pytest

from agent import checkpoint
from agent.notices import MAX_NOTICE_BYTES, NOTICE_FILE, NoticeInvalid, parse_notice
from tests.agent import jobscripts
from tests.agent.test_loop import make_agent, pump, start_assignment, states


@pytest.fixture
def ckpt_root(open_dir: Path) -> Path:
    root = open_dir / "ckpt"
    root.mkdir()
    root.chmod(0o1777)  # the job runs as the unprivileged job user
    return root


def written(broker, assignment_id: str) -> list[dict]:
    return [s for s in broker.statuses_for(assignment_id) if s["state"] == "checkpoint_written"]


def manifest_sha(checkpoint_uri: str) -> str:
    return hashlib.sha256((Path(checkpoint_uri) / "manifest.json").read_bytes()).hexdigest()


def checkpointing_job(ckpt_root: Path, **env: str) -> dict:
    return start_assignment(command=jobscripts.CHECKPOINTING, checkpoint_uri=str(ckpt_root), env=env)


def test_each_save_of_a_real_job_is_reported_once_and_the_job_stays_running(open_dir, broker, clock, ckpt_root):
    broker.state.assignments = [checkpointing_job(ckpt_root, SAVES="3")]
    agent = make_agent(open_dir, broker, clock)
    workdir = agent.runner.workdir_of("a1")
    pump(agent, clock, lambda: len(written(broker, "a1")) == 1, what="first checkpoint report")
    for _ in range(3):  # more looks at an unchanged notice report nothing more
        clock.advance(1)
        agent.step()
    assert len(written(broker, "a1")) == 1
    assert agent.state.jobs["a1"].state == "running" and "a1" in agent.runner.running
    # The heartbeat after the report still shows the job running. (Wait for one: the report can come
    # within the heartbeat period of the first heartbeat, which was sent before the job started.)
    heartbeats_before = len(broker.state.heartbeats)
    pump(agent, clock, lambda: len(broker.state.heartbeats) > heartbeats_before, what="a heartbeat after the report")
    assert [(p["assignment_id"], p["state"]) for p in broker.state.heartbeats[-1]["processes"]] == [("a1", "running")]
    assert len(written(broker, "a1")) == 1

    (workdir / "go-2").touch()
    pump(agent, clock, lambda: len(written(broker, "a1")) == 2, what="second checkpoint report")
    (workdir / "go-3").touch()  # the job saves its last checkpoint and exits at once
    pump(agent, clock, lambda: "exited" in states(broker, "a1"), what="job exit")

    reports = written(broker, "a1")
    assert [r["checkpoint"]["step"] for r in reports] == [10, 20, 30]
    for report in reports:
        cp = report["checkpoint"]
        assert cp["uri"] == str(ckpt_root / checkpoint.checkpointer.step_dir_name(cp["step"]))
        assert cp["manifest_sha256"] == manifest_sha(cp["uri"]) and cp["request_id"] is None
        assert report["message"] == f"checkpoint at step {cp['step']}"
        assert (report["job_id"], report["epoch"]) == ("j1", 1)
    # The last checkpoint is heard before the exit; the job's own states are untouched.
    assert states(broker, "a1") == ["running", "checkpoint_written", "checkpoint_written", "checkpoint_written",
                                    "exited"]
    assert (workdir / "restored").read_text() == "None"  # an old broker said nothing: newest, none yet


def test_a_restart_does_not_report_a_checkpoint_again(open_dir, broker, clock, ckpt_root):
    broker.state.assignments = [checkpointing_job(ckpt_root, SAVES="2", LINGER="1")]
    first = make_agent(open_dir, broker, clock)
    workdir = first.runner.workdir_of("a1")
    pump(first, clock, lambda: len(written(broker, "a1")) == 1, what="first checkpoint report")

    # The agent dies (no shutdown); the new one finds the job as an orphan and stops it.
    second = make_agent(open_dir, broker, clock)
    pump(second, clock, lambda: "failed" in states(broker, "a1"), what="orphan report")
    assert len(written(broker, "a1")) == 1
    assert states(broker, "a1")[-1] == "failed"
    assert json.loads((workdir / NOTICE_FILE).read_text())["step"] == 10


def test_a_checkpoint_written_while_no_agent_watched_is_reported_at_restart(open_dir, broker, clock, ckpt_root):
    broker.state.assignments = [checkpointing_job(ckpt_root, SAVES="2", LINGER="1")]
    first = make_agent(open_dir, broker, clock)
    workdir = first.runner.workdir_of("a1")
    pump(first, clock, lambda: len(written(broker, "a1")) == 1, what="first checkpoint report")
    (workdir / "go-2").touch()
    # Wait on the file itself, without stepping the first agent: it is "dead" from here on.
    deadline = time.monotonic() + 20
    while json.loads((workdir / NOTICE_FILE).read_text())["step"] != 20:
        assert time.monotonic() < deadline, "the job did not save its second checkpoint"
        time.sleep(0.02)

    second = make_agent(open_dir, broker, clock)
    pump(second, clock, lambda: "failed" in states(broker, "a1"), what="orphan report")
    assert [r["checkpoint"]["step"] for r in written(broker, "a1")] == [10, 20]
    assert states(broker, "a1")[-2:] == ["checkpoint_written", "failed"]


def test_the_committed_checkpoint_is_what_a_real_job_restores(open_dir, broker, clock, ckpt_root):
    helper = checkpoint.Checkpointer(uri=str(ckpt_root), env={})
    for step in (5, 6, 7):
        helper.save(step, b"x")
    committed = str(ckpt_root / "step-000000000006")
    broker.state.assignments = [checkpointing_job(ckpt_root, SAVES="1") | {"restore_from": committed}]
    agent = make_agent(open_dir, broker, clock)
    pump(agent, clock, lambda: "exited" in states(broker, "a1"), what="job exit")
    assert (agent.runner.workdir_of("a1") / "restored").read_text() == "6"

    broker.state.assignments = [checkpointing_job(ckpt_root, SAVES="1") | {"id": "a2", "restore_from": ""}]
    pump(agent, clock, lambda: "exited" in states(broker, "a2"), what="second job exit")
    assert (agent.runner.workdir_of("a2") / "restored").read_text() == "None"


# -- hostile notices ----------------------------------------------------------------------------------

GOOD = {"step": 7, "uri": "/ckpt/j1/step-000000000007", "manifest_sha256": "ab" * 32, "request_id": None}


def plant(workdir: Path, name: str, content: bytes) -> None:
    tmp = workdir / f".plant-{name}"
    tmp.write_bytes(content)
    os.replace(tmp, workdir / name)


@pytest.mark.parametrize("how", ["symlink", "oversized", "not_json", "bad_sha", "hard_link", "fifo"])
def test_a_bad_notice_is_ignored_logged_once_and_a_good_one_still_gets_through(
        open_dir, broker, clock, how, caplog, tmp_path):
    broker.state.assignments = [start_assignment(command=jobscripts.SLEEPER)]
    agent = make_agent(open_dir, broker, clock)
    workdir = agent.runner.workdir_of("a1")
    pump(agent, clock, lambda: (workdir / "ready").exists(), what="job ready")
    notice = workdir / NOTICE_FILE
    if how == "symlink":  # a link to a file the agent could read and the job could not
        target = tmp_path / "secret.json"
        target.write_text(json.dumps(GOOD))
        notice.symlink_to(target)
    elif how == "oversized":
        plant(workdir, NOTICE_FILE, json.dumps({**GOOD, "pad": "x" * MAX_NOTICE_BYTES}).encode())
    elif how == "not_json":
        plant(workdir, NOTICE_FILE, b"{not json")
    elif how == "bad_sha":
        plant(workdir, NOTICE_FILE, json.dumps({**GOOD, "manifest_sha256": "AB" * 32}).encode())
    elif how == "hard_link":
        target = tmp_path / "other.json"
        target.write_text(json.dumps(GOOD))
        os.link(target, notice)
    else:
        os.mkfifo(notice)  # opening it for reading must not block the loop
    with caplog.at_level(logging.WARNING, logger="agent.notices"):
        for _ in range(3):
            agent.step()
            clock.advance(1)
        if how in ("oversized", "not_json", "bad_sha"):
            plant(workdir, NOTICE_FILE, b"[1, 2]")  # changed, still bad: no second log line
            agent.step()
    assert written(broker, "a1") == []
    assert len([r for r in caplog.records if "ignoring its checkpoint notice" in r.getMessage()]) == 1

    notice.unlink()
    plant(workdir, NOTICE_FILE, json.dumps(GOOD).encode())
    pump(agent, clock, lambda: written(broker, "a1"), what="report of the good notice")
    assert written(broker, "a1")[0]["checkpoint"] == GOOD


@pytest.mark.parametrize("field, value", [
    ("step", -1), ("step", 2**62 + 1), ("step", True), ("step", "7"), ("uri", ""), ("uri", "x" * 1025),
    ("uri", None), ("manifest_sha256", "ab" * 31), ("manifest_sha256", None), ("request_id", "r" * 129),
    ("request_id", 5),
])
def test_each_field_of_a_notice_is_checked(field, value):
    with pytest.raises(NoticeInvalid, match=field):
        parse_notice({**GOOD, field: value})
    assert parse_notice({**GOOD, "request_id": "r" * 128, "step": 2**62}).request_id == "r" * 128


def test_the_notice_name_is_the_helpers():
    assert NOTICE_FILE == checkpoint.NOTICE_FILE_NAME
