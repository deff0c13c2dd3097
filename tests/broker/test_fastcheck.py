"""The heartbeat's fast check (broker/api/fastcheck.py) never disagrees with the serializer: on the agent's own
bodies it decides, with the serializer's validated data, and on thousands of altered bodies it either gives
exactly what the serializer gives or leaves the body to it (so a bad body still gets the serializer's 400)."""
from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

from agent.backends.fake import FakeBackend
from agent.protocol import heartbeat_payload
from broker.agents.serializers import HeartbeatSerializer, ProcessSerializer
from broker.api.fastcheck import FastCheck

CHECK = FastCheck(HeartbeatSerializer)

# Values that sit on either side of what a field takes: types, bounds, whitespace, NUL, non-ASCII, huge.
TRICKY: list[Any] = [None, True, False, 0, -1, 1, 63, 64, 100, 101, 2**31 - 1, 2**31, 10**400, 1.0, 1.5, -0.0,
                     float("nan"), float("inf"), 1e308, "", " ", "x", " x", "x ", "a\x00b", "é", "\ud800", "7",
                     "HEALTHY", "healthy", "enabled", "running", "stopping", "x" * 32, "x" * 33, "x" * 2001, [],
                     [1], [64], ["a"], [None], {}, {"a": 1}]


def agent_body(shape: str = "4xT4", running: int = 0) -> dict[str, Any]:
    fake = FakeBackend(shape, hostname="n1")
    fake.start()
    body = heartbeat_payload(readings=fake.sample(), sampled_at=time.time(), running={}, max_epoch=7,
                             missed_heartbeats=0, last_error=None)
    body["processes"] = [{"assignment_id": str(10 + k), "job_id": str(20 + k), "epoch": 7, "pid": 1000 + k,
                          "gpu_indices": [k], "state": "running"} for k in range(running)]
    return json.loads(json.dumps(body))  # as the broker's JSON parser hands it over


def serializer_answer(body: Any) -> tuple[bool, Any]:
    serializer = HeartbeatSerializer(data=body)
    ok = serializer.is_valid()
    return ok, (serializer.validated_data if ok else serializer.errors)


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types (1 and 1.0 differ), dicts compared whatever their class."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("shape", ["4xT4", "8xA100-80GB", "1xT4"])
def test_the_agents_own_heartbeat_is_decided_fast_with_the_serializers_data(shape):
    body = agent_body(shape)
    fast = CHECK.fast(body)
    ok, validated = serializer_answer(body)
    assert ok, validated
    assert fast is not None, "a body the agent sends took the slow path"
    assert same(fast, dict(validated))


def test_altered_heartbeats_are_decided_as_the_serializer_decides_or_left_to_it():
    rng = random.Random(12)
    base = agent_body(running=2)
    decided = refused = 0
    for _ in range(4000):
        body = json.loads(json.dumps(base))
        for _ in range(rng.randint(1, 3)):
            where = rng.random()
            # Readings and processes, while an earlier alteration left them lists of objects.
            items = [x for key in ("telemetry", "processes") if isinstance(body.get(key), list)
                     for x in body[key] if isinstance(x, dict)]
            if where < 0.6 and items:  # a reading's or a process's field
                target = rng.choice(items)
                target[rng.choice(list(target) + ["unknown_key"])] = rng.choice(TRICKY)
            elif where < 0.85:  # a top-level field
                body[rng.choice(list(body) + ["unknown_key", "interruption"])] = rng.choice(TRICKY)
            else:  # a field taken away
                target = rng.choice([body, *items])
                if target:
                    target.pop(rng.choice(list(target)))
        fast = CHECK.fast(body)
        ok, answer = serializer_answer(body)
        if fast is not None:
            decided += 1
            assert ok, (body, answer)  # the fast check never takes what the serializer refuses
            assert same(fast, dict(answer)), body
        refused += not ok
    # Both paths were exercised: some altered bodies are still plainly valid, many are refused.
    assert decided > 200 and refused > 1000, (decided, refused)


def test_a_bad_reading_still_gets_the_serializers_error_naming_the_field():
    body = agent_body()
    body["telemetry"][2]["utilization_pct"] = 101
    with pytest.raises(Exception) as caught:
        CHECK.validated(body)
    assert "utilization_pct" in caught.value.detail["telemetry"][2]


def test_a_serializer_with_checks_of_its_own_is_never_decided_fast():
    """ProcessSerializer has none; one that adds `validate` gets no fast path at all."""
    class Checked(ProcessSerializer):
        def validate(self, attrs):
            raise AssertionError("must run")

    body = agent_body(running=1)["processes"][0]
    assert FastCheck(ProcessSerializer).fast(body) is not None
    assert FastCheck(Checked).fast(body) is None


@pytest.mark.parametrize("extra", [
    {"interruption": {"kind": "spot", "action": "terminate", "deadline": 1796000000, "source": "aws"}},
    {"interruption": {"kind": "spot", "action": "stop", "deadline": 12.5, "source": "local"}},
    {"metrics_url": "http://10.0.0.7:9400/metrics"},
])
def test_a_spot_notice_or_a_metrics_address_gets_the_serializers_data(extra):
    body = {**agent_body(running=1), **extra}
    ok, validated = serializer_answer(body)
    assert ok, validated
    fast = CHECK.fast(body)
    assert fast is None or same(fast, dict(validated))
    assert same(dict(CHECK.validated(body)), dict(validated))
