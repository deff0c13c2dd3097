"""Spot interruption notices: the watcher against a local metadata server, and the agent passing a
notice to the broker at once and in every heartbeat after."""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

import pytest

from agent import cli
from agent.spot import SpotWatcher
from tests.agent.fake_metadata import FakeMetadata
from tests.agent.test_loop import make_agent, pump


@pytest.fixture
def metadata():
    fake = FakeMetadata()
    yield fake
    fake.stop()


def at(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(timezone.utc).timestamp()


def test_aws_no_notice_then_a_notice_with_its_time(metadata):
    watcher = SpotWatcher("aws", metadata.url)
    assert watcher.check_once() is None and watcher.check_once() is None
    metadata.instance_action = {"action": "terminate", "time": "2026-12-01T12:00:00Z"}
    notice = watcher.check_once()
    assert notice.to_json() == {"kind": "spot", "action": "terminate", "deadline": at("2026-12-01T12:00:00Z"),
                                "source": "aws"}
    # IMDSv2: one token, asked for with its TTL, then reused on every poll.
    assert metadata.paths() == ["PUT /latest/api/token"] + ["GET /latest/meta-data/spot/instance-action"] * 3
    put_headers = metadata.requests[0][2]
    assert put_headers["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"


def test_aws_token_refused_is_fetched_again(metadata):
    watcher = SpotWatcher("aws", metadata.url)
    assert watcher.check_once() is None
    metadata.tokens.clear()  # the metadata service restarted
    assert watcher.check_once() is None
    metadata.instance_action = {"action": "stop", "time": "2026-12-01T12:02:00Z"}
    assert watcher.check_once().action == "stop"
    assert metadata.paths().count("PUT /latest/api/token") == 2


def test_gcp_preempted_gives_thirty_seconds(metadata):
    watcher = SpotWatcher("gcp", metadata.url, wall=lambda: 1000.0)
    assert watcher.check_once() is None
    metadata.preempted = True
    assert watcher.check_once().to_json() == {"kind": "spot", "action": "terminate", "deadline": 1030.0,
                                              "source": "gcp"}
    assert metadata.requests[-1][2]["metadata-flavor"] == "Google"


def test_errors_are_logged_once_and_retried(metadata, caplog):
    watcher = SpotWatcher("local", metadata.url)
    metadata.fail_with = 500
    with caplog.at_level(logging.WARNING, logger="agent.spot"):
        for _ in range(3):
            assert watcher.check_once() is None
    assert len([r for r in caplog.records if "spot notice:" in r.getMessage()]) == 1
    metadata.fail_with = None
    metadata.instance_action = {"action": "hibernate", "time": "2026-12-01T12:00:00Z"}
    assert watcher.check_once().source == "local"


def test_nothing_listening_and_garbage_are_errors_not_notices(metadata):
    metadata.stop()
    assert SpotWatcher("aws", metadata.url).check_once() is None
    other = FakeMetadata()
    try:
        other.instance_action = {"action": "explode", "time": "soon"}
        assert SpotWatcher("aws", other.url).check_once() is None
    finally:
        other.stop()


def test_a_hanging_metadata_service_costs_one_timeout(metadata):
    metadata.hang_s = 3.0
    watcher = SpotWatcher("gcp", metadata.url)
    started = time.monotonic()
    assert watcher.check_once() is None
    assert time.monotonic() - started < 2.0  # the 1 s timeout, not the service's 3 s


# -- through the agent ------------------------------------------------------------------------------


def interruptions(broker) -> list:
    return [h.get("interruption") for h in broker.state.heartbeats]


def test_a_notice_goes_out_in_a_heartbeat_at_once_and_in_every_one_after(open_dir, broker, clock, metadata):
    agent = make_agent(open_dir, broker, clock, spot_notice="local", metadata_url=metadata.url, spot_poll_s=0.05)
    try:
        agent.step()
        clock.advance(1)
        agent.step()
        assert interruptions(broker) == [None]  # no field without a notice
        metadata.instance_action = {"action": "terminate", "time": "2026-12-01T12:00:00Z"}
        # The fake clock stands still: only the notice can make the next heartbeat due now.
        pump(agent, clock, lambda: len(broker.state.heartbeats) == 2, advance=0, what="heartbeat with the notice")
        expected = {"kind": "spot", "action": "terminate", "deadline": at("2026-12-01T12:00:00Z"), "source": "local"}
        assert interruptions(broker) == [None, expected]
        for _ in range(3):
            agent.step()
        assert len(broker.state.heartbeats) == 2  # one extra heartbeat, then the usual period
        clock.advance(5)
        agent.step()
        assert interruptions(broker) == [None, expected, expected]
    finally:
        agent.shutdown()


def test_a_broker_that_refuses_the_field_still_gets_heartbeats(open_dir, broker, clock, metadata):
    broker.state.unknown_heartbeat_fields = {"interruption"}
    metadata.instance_action = {"action": "terminate", "time": "2026-12-01T12:00:00Z"}
    agent = make_agent(open_dir, broker, clock, spot_notice="aws", metadata_url=metadata.url, spot_poll_s=0.05)
    try:
        agent.start()
        deadline = time.monotonic() + 10
        while agent.spot.notice is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for _ in range(3):
            agent.step()
            clock.advance(5)
        assert len(broker.state.heartbeats) == 3 and interruptions(broker) == [None] * 3
    finally:
        agent.shutdown()


def test_a_hanging_metadata_service_never_delays_the_loop(open_dir, broker, clock, metadata):
    metadata.hang_s = 3.0
    agent = make_agent(open_dir, broker, clock, spot_notice="aws", metadata_url=metadata.url, spot_poll_s=0.05)
    try:
        for _ in range(5):
            started = time.monotonic()
            agent.step()
            assert time.monotonic() - started < 0.9
            clock.advance(5)
        assert len(broker.state.heartbeats) == 5 and interruptions(broker) == [None] * 5
    finally:
        agent.shutdown()


def test_spot_options_on_the_command_line(capsys, tmp_path):
    base = ["--server", "http://127.0.0.1:1", "--join-token", "t", "--fake-gpus", "1xT4", "--state-dir", str(tmp_path)]
    assert cli.main([*base, "--spot-notice", "local"]) == cli.EXIT_USAGE
    assert "--spot-notice local needs --metadata-url" in capsys.readouterr().err
    assert cli.main([*base, "--metadata-url", "http://127.0.0.1:9"]) == cli.EXIT_USAGE
    assert "--metadata-url needs --spot-notice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        cli.main([*base, "--spot-notice", "azure"])
    assert exited.value.code == cli.EXIT_USAGE
