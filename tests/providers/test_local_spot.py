"""Spot notices in the local provider: each instance's own metadata endpoint (answering as AWS's
IMDSv2 does), `interrupt(ref, after_seconds)`, the instance ending itself at the notice's time, and
a real agent passing the notice to a broker."""
from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path


from providers.base import InstanceState
from providers.local import CloudSimulation, LocalProvider
from providers.local.processes import is_alive
from tests.agent.fake_broker import FakeBroker
from tests.providers.conftest import BROKER_ID, make_request
from tests.providers.test_local import local_request, make_local, pid_of, wait_for  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]


def metadata_url_of(tmp_path: Path, node_name: str) -> str:
    argv = json.loads(wait_for(tmp_path / f"{node_name}.json"))["argv"]
    return argv[argv.index("--metadata-url") + 1]


def call(method: str, url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {}, data=b"" if method == "PUT" else None)
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=2) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as err:
            return err.code, b""
        except urllib.error.URLError:  # the instance process may still be starting its server
            assert time.monotonic() < deadline, f"nothing answers at {url}"
            time.sleep(0.05)


def instance_action(base: str) -> tuple[int, bytes]:
    status, token = call("PUT", f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
    assert status == 200 and token
    return call("GET", f"{base}/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": token.decode()})


def test_the_endpoint_answers_like_imdsv2_and_shows_a_posted_notice(make_local, tmp_path: Path) -> None:
    provider = make_local()
    request = local_request("local-1xL4", spot=True)
    info = provider.provision(request)
    base = metadata_url_of(tmp_path, request.node_name)

    assert call("PUT", f"{base}/latest/api/token")[0] == 400  # no TTL header: refused, as IMDSv2 does
    assert call("GET", f"{base}/latest/meta-data/spot/instance-action")[0] == 401  # no token
    assert instance_action(base)[0] == 404  # no notice yet
    port_only = re.sub(r"/[^/]+$", "", base)
    ttl = {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}
    assert call("PUT", f"{port_only}/latest/api/token", ttl)[0] == 404  # without the instance's secret path: nothing

    before = time.time()
    provider.interrupt(info.ref, after_seconds=120)
    status, body = instance_action(base)
    notice = json.loads(body)
    assert status == 200 and notice["action"] == "terminate"
    deadline = datetime.fromisoformat(notice["time"].replace("Z", "+00:00")).timestamp()
    assert before + 119 <= deadline <= before + 122
    assert provider.describe(info.ref).state is InstanceState.RUNNING  # still up until then


def test_the_instance_ends_itself_when_the_notice_runs_out(make_local, tmp_path: Path) -> None:
    provider = make_local()
    info = provider.provision(local_request("local-1xL4", spot=True))
    pid = pid_of(provider, info.ref.instance_id)
    provider.interrupt(info.ref, after_seconds=1)
    deadline = time.monotonic() + 10
    while is_alive(*pid):  # nobody asks the provider meanwhile: the instance goes on its own
        assert time.monotonic() < deadline, "the instance outlived its spot notice"
        time.sleep(0.05)
    described = provider.describe(info.ref)
    assert (described.state, described.state_reason) == (InstanceState.TERMINATED, "spot-interruption")


def test_the_provider_terminates_an_instance_past_its_notice(make_local) -> None:
    now = [time.time()]
    provider = make_local(clock=lambda: now[0])
    info = provider.provision(local_request("local-1xL4", spot=True))
    pid = pid_of(provider, info.ref.instance_id)
    provider.interrupt(info.ref, after_seconds=120)
    provider.interrupt(info.ref, after_seconds=600)  # a second notice never moves the first one later
    now[0] += 121  # the provider's clock says the time is up (the instance's own has not got there)
    assert [(i.state, i.state_reason) for i in provider.list_owned()] == [
        (InstanceState.TERMINATED, "spot-interruption")]
    assert not is_alive(*pid)


def test_tick_posts_notices_ahead_when_asked_to(make_local, tmp_path: Path) -> None:
    provider = make_local(simulation=CloudSimulation(spot_interruption_probability=1.0, spot_notice_seconds=120))
    request = local_request("local-1xL4", spot=True)
    info = provider.provision(request)
    (noticed,) = provider.tick()
    assert noticed.ref == info.ref and noticed.state is InstanceState.RUNNING
    assert instance_action(metadata_url_of(tmp_path, request.node_name))[0] == 200
    assert provider.tick() == []  # already noticed: not drawn again


def test_a_real_agent_tells_the_broker_about_the_notice(tmp_path: Path) -> None:
    broker = FakeBroker()
    broker.state.join_token = "join-secret-123"
    provider = LocalProvider(broker_id=BROKER_ID, state_dir=tmp_path / "state", python=sys.executable,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, stop_timeout_s=10)
    base = make_request(provider="local", instance_type="local-1xL4", zone="local-a", region="local", spot=True)
    request = base.__class__(**{**base.__dict__, "agent_server_url": broker.url})
    info = provider.provision(request)
    try:
        provider.interrupt(info.ref, after_seconds=120)  # before the agent's first look at its endpoint
        deadline = time.monotonic() + 30
        while not any(h.get("interruption") for h in broker.state.heartbeats):
            log = (tmp_path / "state" / "logs" / f"{info.ref.instance_id}.log").read_text()
            assert provider.describe(info.ref).state is not InstanceState.TERMINATED, f"agent exited:\n{log}"
            assert time.monotonic() < deadline, f"no heartbeat carried the notice:\n{log}"
            time.sleep(0.05)
        interruption = next(h["interruption"] for h in broker.state.heartbeats if h.get("interruption"))
        assert interruption["kind"] == "spot" and interruption["action"] == "terminate"
        assert interruption["source"] == "local"
        assert time.time() + 100 < interruption["deadline"] <= time.time() + 122
    finally:
        assert provider.terminate(info.ref).state is InstanceState.TERMINATED
        broker.stop()



def test_a_secret_that_looks_like_an_option_still_starts_the_instance(make_local, tmp_path: Path,
                                                                      monkeypatch) -> None:
    """The secret reaches the instance process as `--secret=VALUE`: one that began with "-" (a URL-safe
    token does, one launch in 64) made the instance die at once ("--secret: expected one argument")."""
    from providers.local import provider as local_provider

    for draw in ("token_hex", "token_urlsafe"):
        monkeypatch.setattr(local_provider.secrets, draw, lambda n: "-" + "a" * (2 * n - 1))
    provider = make_local()
    request = local_request("local-1xL4", spot=True)
    info = provider.provision(request)
    base = metadata_url_of(tmp_path, request.node_name)
    assert instance_action(base)[0] == 404  # the endpoint answers: the instance is up
    assert provider.describe(info.ref).state is InstanceState.RUNNING
